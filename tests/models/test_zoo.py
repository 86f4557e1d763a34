"""The model zoo: every model builds deterministically, runs, has the right output shapes,
and goes through torch.export (which cpu_opt.optimize's capture step depends on)."""
import dataclasses

import pytest
import torch

from cpu_opt.models import ZOO, BaseModelOutputWithPooling, ModelOutput, bert, gpt2

NAMES = sorted(ZOO)
BATCH = 2

# (name) -> expected output for small size at BATCH: shape, or a dict of shapes
EXPECTED = {
    "resnet18": (BATCH, 100),
    "resnet50": (BATCH, 100),
    "vit_b16": (BATCH, 100),
    "mobilenetv3": (BATCH, 100),
    "mlp": (BATCH, 10),
    "gpt2_small": (BATCH, 32, 1000),
    "bert_base": {"last_hidden_state": (BATCH, 32, 128), "pooler_output": (BATCH, 128)},
}


def _shapes(out):
    if torch.is_tensor(out):
        return tuple(out.shape)
    return {k: tuple(v.shape) for k, v in out.items()}


def _flat(out):
    return [out] if torch.is_tensor(out) else list(out.to_tuple())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small models gain nothing from threads, and on a shared machine OpenMP threads that
    spin-wait for a busy core make these tests several times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def built():
    """Each small model built once, with its example inputs and eager output."""
    torch.manual_seed(0)
    res = {}
    with torch.no_grad():
        for name in NAMES:
            spec = ZOO[name]
            model = spec.build("small")
            inputs = spec.example_inputs(BATCH, "small")
            res[name] = (model, inputs, spec.call(model, inputs))
    return res


@pytest.mark.parametrize("name", NAMES)
def test_builds_runs_and_shapes(built, name):
    model, inputs, out = built[name]
    assert not model.training
    assert _shapes(out) == EXPECTED[name]
    for t in _flat(out):
        assert torch.isfinite(t).all()
        assert 1e-3 < t.float().std() < 1e3, "activations should be in a realistic range"


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_across_builds(built, name):
    spec = ZOO[name]
    model, inputs, out = built[name]
    again = spec.build("small")
    sd1, sd2 = model.state_dict(), again.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    inputs2 = spec.example_inputs(BATCH, "small")
    for a, b in zip(inputs.values() if isinstance(inputs, dict) else inputs,
                    inputs2.values() if isinstance(inputs2, dict) else inputs2):
        assert torch.equal(a, b)
    with torch.no_grad():
        out2 = spec.call(again, inputs2)
    for a, b in zip(_flat(out), _flat(out2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_example_inputs(name):
    spec = ZOO[name]
    full = spec.example_inputs(1, "full")
    if spec.kind == "vision":
        assert full[0].shape == (1, 3, 224, 224)
        assert spec.example_inputs(3, "small")[0].shape == (3, 3, 64, 64)
    elif spec.kind == "text":
        assert full["input_ids"].shape == (1, 128)
        small = spec.example_inputs(4, "small")
        assert small["input_ids"].shape == (4, 32)
        if "attention_mask" in small:
            m = small["attention_mask"]
            assert m[0].all() and not m[1:].all(), "rows after the first are padded"
            assert (small["input_ids"][m == 0] == 0).all()
            assert full["attention_mask"].all()
    with pytest.raises(ValueError):
        spec.example_inputs(1, "medium")


@pytest.mark.parametrize("name", NAMES)
def test_gemm_flops(name):
    spec = ZOO[name]
    f1 = spec.gemm_flops(1, "small")
    assert f1 > 0
    assert spec.gemm_flops(4, "small") == pytest.approx(4 * f1)


def test_gemm_flops_full_sizes_match_the_literature():
    gf = {n: ZOO[n].gemm_flops(1, "full") / 1e9 for n in ("resnet18", "resnet50", "bert_base", "vit_b16")}
    # 2 x the usual GMAC counts: 1.8, 4.1, ~11 (seq 128), 17.6
    assert gf["resnet18"] == pytest.approx(3.6, rel=0.05)
    assert gf["resnet50"] == pytest.approx(8.2, rel=0.05)
    assert gf["bert_base"] == pytest.approx(22.4, rel=0.05)
    assert gf["vit_b16"] == pytest.approx(35.1, rel=0.05)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenetv3"])
def test_batchnorm_stats_are_not_trivial(built, name):
    model = built[name][0]
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns
    for bn in bns:
        assert bn.running_mean.abs().max() > 1e-3
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        assert not torch.allclose(bn.weight, torch.ones_like(bn.weight))


# ------------------------------------------------------------------------------ outputs

def test_model_output_is_dict_like_and_tuple_like(built):
    out = built["bert_base"][2]
    assert isinstance(out, BaseModelOutputWithPooling) and isinstance(out, ModelOutput)
    assert dataclasses.is_dataclass(out)
    assert out.keys() == ["last_hidden_state", "pooler_output"]
    assert out["last_hidden_state"] is out.last_hidden_state
    assert out[0] is out.last_hidden_state and out[1] is out.pooler_output
    assert [k for k, _ in out.items()] == out.keys()
    assert out.to_tuple() == (out.last_hidden_state, out.pooler_output)
    assert "pooler_output" in out and len(out) == 2 and list(out) == out.keys()
    with pytest.raises(KeyError):
        out["logits"]


def test_model_output_skips_none():
    out = BaseModelOutputWithPooling(last_hidden_state=torch.zeros(1))
    assert out.keys() == ["last_hidden_state"]
    assert len(out.to_tuple()) == 1
    with pytest.raises(KeyError):
        out["pooler_output"]


# ------------------------------------------------------------------------------ BERT / GPT-2

def test_bert_explicit_attention_matches_sdpa():
    sdpa = bert.build("small", attn_impl="sdpa")
    explicit = bert.build("small", attn_impl="explicit")
    inputs = ZOO["bert_base"].example_inputs(4, "small")  # with padding
    with torch.no_grad():
        a, b = sdpa(**inputs), explicit(**inputs)
    for k in a.keys():
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)


def test_bert_padding_mask_is_applied():
    model = bert.build("small")
    inputs = ZOO["bert_base"].example_inputs(2, "small")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    n = int(mask[1].sum())
    with torch.no_grad():
        padded = model(ids, mask).last_hidden_state[1, :n]
        alone = model(ids[1:, :n], mask[1:, :n]).last_hidden_state[0]
        unmasked = model(ids, torch.ones_like(mask)).last_hidden_state[1, :n]
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(padded, unmasked, atol=1e-3)


def test_bert_rejects_unknown_attn_impl():
    with pytest.raises(ValueError, match="attn_impl"):
        bert.build("small", attn_impl="flash")


def test_gpt2_lm_head_is_tied_and_mask_path_matches_causal():
    model = gpt2.build("small")
    assert model.lm_head.weight is model.wte.weight
    ids = ZOO["gpt2_small"].example_inputs(2, "small")["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # right padding: earlier positions are unaffected under causal attention
    with torch.no_grad():
        causal = model(ids)
        masked = model(ids, mask)
    torch.testing.assert_close(masked[0], causal[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked[1, :20], causal[1, :20], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ torch.export

@pytest.mark.parametrize("name", NAMES)
def test_torch_export(built, name):
    model, inputs, out = built[name]
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    ep = torch.export.export(model, args, kwargs, strict=False)
    with torch.no_grad():
        got = ep.module()(*args, **kwargs)
    assert type(got) is type(out)
    for a, b in zip(_flat(got), _flat(out)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
