"""quant/api.py — prepare / calibrate / convert, report, families, saving and resuming a
calibration, repeatability, quantize_dynamic and quantize_weight_only, autotune; on the zoo's small
MLP (Linear + ReLU/GELU/SiLU) and a small CNN (strided, depthwise, pointwise and grouped convs).

Accuracy floor here: cosine >= 0.99 to the fp32 model (the issue's threshold)."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_testutil import (REDUCE_RANGE, batches, buildable_families, cosine, minmax_mapping,  # noqa: E402
                            minmax_qconfig, small_cnn, sqnr_db)

import cpu_opt  # noqa: E402
from cpu_opt import quant  # noqa: E402
from cpu_opt.models import ZOO  # noqa: E402
from cpu_opt.quant import kernels as K  # noqa: E402
from cpu_opt.quant.modules import (DynamicQuantizedLinear, ObservedLayer, QuantizedConv2d,  # noqa: E402
                                   QuantizedLinear, WeightOnlyLinear)
from cpu_opt.quant.observer import HistogramObserver, MovingAverageMinMaxObserver  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")

MIN_COSINE = 0.99


def _mlp():
    return ZOO["mlp"].build("small")            # 64-256-256-128-10, ReLU, GELU, SiLU


MODELS = {
    "mlp": (_mlp, (16, 64)),
    "cnn": (small_cnn, (4, 3, 16, 16)),
}


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def _int8(name, mapping=None, n_batches=4, **convert_kw):
    make, shape = MODELS[name]
    model = make()
    data = batches(shape, n_batches, seed=100)
    p = quant.prepare(model, mapping if mapping is not None else minmax_mapping(), data[0])
    quant.calibrate(p, data)
    return model, p, quant.convert(p, **convert_kw), shape


def _test_input(shape, seed=7):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def converted():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _int8(name)
        return cache[name]

    return get


# ------------------------------------------------------------------------------------- convert
@pytest.mark.parametrize("name", list(MODELS))
def test_convert_replaces_every_layer_and_reports_its_family(name, converted):
    model, p, q, shape = converted(name)
    layers = _layers(model)
    rep = quant.report(q)
    assert rep["stage"] == "converted" and rep["mode"] == "static"
    assert {r["layer"] for r in rep["layers"]} == set(layers)
    assert len(rep["layers"]) == len(layers)
    for r in rep["layers"]:
        want = "linear" if isinstance(layers[r["layer"]], nn.Linear) else "conv2d"
        assert r["kind"] == want and r["int8"] is True
        assert r["family"] in ("fbgemm", "torch_onednn", "onednn", "amx"), r
        assert r["why"]
        mod = q.get_submodule(r["layer"])
        assert isinstance(mod, QuantizedLinear if want == "linear" else QuantizedConv2d)
        assert mod.kernel.family == r["family"]
    assert sum(rep["by_family"].values()) == len(layers)
    assert rep["fp32_layers"] == [] and rep["observed"] == []
    assert not any(isinstance(m, ObservedLayer) for m in q.modules())
    x = _test_input(shape)
    with torch.no_grad():
        ref, out = model(x), q(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert cosine(out, ref) >= MIN_COSINE
    assert out is not ref and not torch.equal(out, ref)      # int8 really ran: not the fp32 answer


@pytest.mark.parametrize("name", list(MODELS))
def test_default_histogram_mapping(name):
    model, p, q, shape = _int8(name, quant.default_qconfig_mapping(), n_batches=2)
    x = _test_input(shape)
    with torch.no_grad():
        assert cosine(q(x), model(x)) >= MIN_COSINE
    assert len(quant.report(q)["layers"]) == len(_layers(model))


def test_prepared_model_reports_its_observers_and_runs_unchanged():
    model = _mlp()
    p = quant.prepare(model, minmax_mapping())
    rep = quant.report(p)
    assert rep["stage"] == "prepared" and set(rep["observed"]) == set(_layers(model)) and rep["layers"] == []
    x = _test_input((8, 64))
    with torch.no_grad():
        assert torch.equal(p(x), model(x))                  # observing does not change the answer
    assert not any(isinstance(m, ObservedLayer) for m in model.modules())   # prepare copied the model
    with pytest.raises(quant.QuantizationError):
        quant.report(model)


# ------------------------------------------------------------------------------------- fp32 layers
@pytest.mark.parametrize("name,keep", [("mlp", "2"), ("cnn", "dw"), ("cnn", "fc")])
def test_qconfig_none_keeps_the_layer_fp32_and_reports_it(name, keep):
    mapping = minmax_mapping().set_module_name(keep, None)
    model, p, q, shape = _int8(name, mapping)
    layer = q.get_submodule(keep)
    assert type(layer) is type(model.get_submodule(keep))         # still nn.Linear / nn.Conv2d
    assert torch.equal(layer.weight, model.get_submodule(keep).weight)
    rep = quant.report(q)
    assert keep not in {r["layer"] for r in rep["layers"]}
    assert {r["layer"] for r in rep["layers"]} == set(_layers(model)) - {keep}
    fp32 = {f["layer"]: f["why"] for f in rep["fp32_layers"]}
    assert keep in fp32 and "None" in fp32[keep]
    x = _test_input(shape)
    with torch.no_grad():
        assert cosine(q(x), model(x)) >= MIN_COSINE


def test_layers_the_backend_cannot_take_stay_fp32_and_are_reported():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.same = nn.Conv2d(3, 8, 3, padding="same")
            self.reflect = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
            self.ok = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return self.ok(self.reflect(self.same(x)))

    torch.manual_seed(0)
    model = Odd().eval()
    data = batches((2, 3, 8, 8), 2, seed=1)
    q = quant.convert(quant.calibrate(quant.prepare(model, minmax_mapping()), data))
    rep = quant.report(q)
    assert [r["layer"] for r in rep["layers"]] == ["ok"]
    fp32 = {f["layer"]: f["why"] for f in rep["fp32_layers"]}
    assert set(fp32) == {"same", "reflect"} and all("padding" in w for w in fp32.values())
    assert type(q.same) is nn.Conv2d and type(q.reflect) is nn.Conv2d


# ------------------------------------------------------------------------------------- families
def _forced(name, kind_families):
    """Convert with every layer forced onto one family per kind; (model, converted, report)."""
    make, shape = MODELS[name]
    model = make()
    data = batches(shape, 3, seed=100)
    p = quant.calibrate(quant.prepare(model, minmax_mapping()), data)
    fams = {n: kind_families["linear" if isinstance(m, nn.Linear) else "conv2d"] for n, m in _layers(model).items()}
    return model, p, quant.convert(p, families=fams), fams


LINEAR_FAMILIES = buildable_families("linear")
CONV_FAMILIES = buildable_families("conv2d")


@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_families_forced_on_the_mlp(family):
    model, p, q, fams = _forced("mlp", {"linear": family})
    rep = quant.report(q)
    assert {r["layer"]: r["family"] for r in rep["layers"]} == fams
    assert all(r["why"] == "chosen by the caller" for r in rep["layers"])
    assert rep["by_family"] == {family: len(fams)}
    x = _test_input((16, 64))
    with torch.no_grad():
        out, ref = q(x), model(x)
        assert cosine(out, ref) >= MIN_COSINE
        # the families are exact on the same int8 operands: they agree with each other far more
        # closely than with fp32 (FBGEMM as the yardstick)
        base = quant.convert(p, families={n: "fbgemm" for n in fams})(x)
    assert torch.allclose(out, base, rtol=1e-4, atol=1e-4 * base.abs().max().item())


@pytest.mark.parametrize("conv_family", CONV_FAMILIES)
@pytest.mark.parametrize("linear_family", ["fbgemm", "torch_onednn"])
def test_families_forced_on_the_cnn(conv_family, linear_family):
    if conv_family == "fbgemm" and K.activation_qmax() == 255:
        # the CNN's depthwise layer on FBGEMM would saturate with 8-bit activations (VNNI): refused
        with pytest.raises(ValueError, match=r"FBGEMM's depthwise convolution .* saturates"):
            _forced("cnn", {"linear": linear_family, "conv2d": conv_family})
        return
    model, p, q, fams = _forced("cnn", {"linear": linear_family, "conv2d": conv_family})
    rep = quant.report(q)
    assert {r["layer"]: r["family"] for r in rep["layers"]} == fams
    for r in rep["layers"]:
        assert type(q.get_submodule(r["layer"]).kernel) is \
            (K.LINEAR_KERNELS if r["kind"] == "linear" else K.CONV_KERNELS)[r["family"]]
    x = _test_input((4, 3, 16, 16))
    with torch.no_grad():
        assert cosine(q(x), model(x)) >= MIN_COSINE


def test_bad_families_raise():
    make, shape = MODELS["mlp"]
    p = quant.calibrate(quant.prepare(make(), minmax_mapping()), batches(shape, 1, seed=1))
    with pytest.raises(ValueError, match="family must be one of"):
        quant.convert(p, families={"0": "openvino"})
    with pytest.raises(ValueError, match="not observed"):
        quant.convert(p, families={"no_such_layer": "fbgemm"})
    pc = quant.calibrate(quant.prepare(small_cnn(), minmax_mapping()), batches((2, 3, 8, 8), 1, seed=1))
    with pytest.raises(ValueError, match="family must be one of"):
        quant.convert(pc, families={"conv1": "openvino"})


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("with_example", [True, False])
def test_convert_without_calibration_names_the_layer(with_example):
    model = _mlp()
    p = quant.prepare(model, minmax_mapping(), (_test_input((2, 64)),) if with_example else None)
    with pytest.raises(quant.QuantizationError, match=r"layer '0'.*no input"):
        quant.convert(p)


def test_convert_names_the_layer_the_calibration_never_reached():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, use_b=False):
            return self.b(x) if use_b else self.a(x)

    p = quant.calibrate(quant.prepare(TwoHeads(), minmax_mapping()), [torch.randn(2, 8)])
    with pytest.raises(quant.QuantizationError, match="'b'"):
        quant.convert(p)


def test_calibrate_refuses_empty_data_and_unprepared_models():
    p = quant.prepare(_mlp(), minmax_mapping())
    with pytest.raises(ValueError, match="empty"):
        quant.calibrate(p, [])
    with pytest.raises(ValueError, match="empty"):
        quant.calibrate(p, iter(()))
    with pytest.raises(quant.QuantizationError, match="prepare"):
        quant.calibrate(_mlp(), [(_test_input((2, 64)),)])
    with pytest.raises(quant.QuantizationError):
        quant.convert(_mlp())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_calibration_refuses_nan_and_inf(bad):
    p = quant.prepare(_mlp(), minmax_mapping())
    x = _test_input((4, 64))
    x[1, 3] = bad
    with pytest.raises(ValueError):
        quant.calibrate(p, [(x,)])


@pytest.mark.skipif(not REDUCE_RANGE, reason="8-bit activations are exact with VNNI")
def test_prepare_warns_about_8bit_activations_without_vnni():
    from cpu_opt.quant import MinMaxObserver, QConfig, QConfigMapping
    from cpu_opt.quant.qconfig import default_weight_observer

    act = MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False)
    mapping = QConfigMapping().set_global(QConfig(activation=act, weight=default_weight_observer()))
    with pytest.warns(RuntimeWarning, match="VNNI"):
        quant.prepare(_mlp(), mapping)


def test_prepare_refuses_bad_arguments():
    with pytest.raises(TypeError):
        quant.prepare(lambda x: x, minmax_mapping())
    with pytest.raises(TypeError):
        quant.prepare(_mlp(), {"": minmax_qconfig()})
    with pytest.warns(RuntimeWarning, match="selects no"):
        quant.prepare(_mlp(), quant.QConfigMapping())


# ------------------------------------------------------------------------------------- save / resume
def _mapping_with(observer_cls, **kw):
    from cpu_opt.quant import QConfig, QConfigMapping
    from cpu_opt.quant.qconfig import default_weight_observer

    act = observer_cls.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=REDUCE_RANGE, **kw)
    qc = QConfig(activation=act, weight=default_weight_observer())
    return QConfigMapping().set_object_type(nn.Linear, qc).set_object_type(nn.Conv2d, qc)


@pytest.mark.parametrize("observer", ["minmax", "moving_average", "histogram", "smoothquant"])
def test_calibration_saved_halfway_and_resumed_gives_the_same_int8_model(observer, tmp_path):
    if observer == "smoothquant":
        mapping = quant.transformer_qconfig_mapping(smoothquant_alpha=0.5)
    else:
        mapping = {"minmax": minmax_mapping, "moving_average": lambda: _mapping_with(MovingAverageMinMaxObserver),
                   "histogram": lambda: _mapping_with(HistogramObserver, bins=256)}[observer]()
    model = _mlp()
    g = torch.Generator().manual_seed(3)
    # batches of different ranges: the widest first, then one that widens a histogram's range again
    data = [(torch.randn(8, 64, generator=g) * s,) for s in (3.0, 1.0, 0.5, 2.0)]
    whole = quant.convert(quant.calibrate(quant.prepare(model, mapping), data))

    first = quant.calibrate(quant.prepare(model, mapping), data[:2])
    sd = first.state_dict()
    assert any("observer" in k for k in sd), sorted(sd)[:10]
    torch.save(sd, tmp_path / "calib.pt")
    fresh = quant.prepare(model, mapping)
    fresh.load_state_dict(torch.load(tmp_path / "calib.pt"))
    resumed = quant.convert(quant.calibrate(fresh, data[2:]))

    x = _test_input((16, 64))
    with torch.no_grad():
        a, b = whole(x), resumed(x)
    assert torch.equal(a, b)
    # and the state really mattered: calibrating only the second half gives another model
    only_second = quant.convert(quant.calibrate(quant.prepare(model, mapping), data[2:]))
    with torch.no_grad():
        assert not torch.equal(only_second(x), a)


# ------------------------------------------------------------------------------------- repeatability
@pytest.mark.parametrize("name", list(MODELS))
def test_converting_twice_gives_identical_models(name, converted):
    model, p, q, shape = converted(name)
    assert quant.report(p)["stage"] == "prepared"                       # convert copied
    assert all(isinstance(p.get_submodule(n), ObservedLayer) for n in _layers(model))
    q2 = quant.convert(p)
    x = _test_input(shape)
    with torch.no_grad():
        assert torch.equal(q(x), q2(x))
    assert [r["family"] for r in quant.report(q)["layers"]] == [r["family"] for r in quant.report(q2)["layers"]]


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_model_is_repeatable_and_does_not_reuse_its_outputs(name, converted):
    model, p, q, shape = converted(name)
    x1, x2 = _test_input(shape, 1), _test_input(shape, 2)
    x1_copy = x1.clone()
    with torch.no_grad():
        y1 = q(x1)
        y1_copy = y1.clone()
        y2 = q(x2)
        assert torch.equal(y1, y1_copy)             # the second call did not write into the first output
        assert torch.equal(q(x1), y1_copy)          # same input, same bits
        assert not torch.equal(y1, y2)
    assert torch.equal(x1, x1_copy)                 # nor into its input


# ------------------------------------------------------------------------------------- dynamic / weight-only
def _check_int8_weight(w_int8, scales, w_float):
    assert w_int8.dtype == torch.int8
    assert int(w_int8.abs().max()) <= 127 and int(w_int8.abs().max()) >= 100   # the range is used
    err = (w_int8.float() * scales.float()[:, None] - w_float.detach().float()).abs()
    assert bool((err <= scales.float()[:, None] / 2 * (1 + 1e-5) + 1e-8).all())


@pytest.mark.parametrize("per_token", [False, True], ids=["per_tensor", "per_token"])
def test_quantize_dynamic(per_token):
    model = _mlp()
    q = quant.quantize_dynamic(model, per_token=per_token)
    layers = _layers(model)
    for n, lin in layers.items():
        m = q.get_submodule(n)
        assert isinstance(m, DynamicQuantizedLinear) and m.per_token is per_token
        assert isinstance(model.get_submodule(n), nn.Linear)               # not in place
        if per_token:
            assert m.family == "torch_int_mm"
            _check_int8_weight(m.wq_t.t(), m.w_scales, lin.weight)
        else:
            assert m.family == "fbgemm"
            qw, b = torch.ops.quantized.linear_unpack(m.kernel.packed)
            assert qw.dtype == torch.qint8
            _check_int8_weight(qw.int_repr(), qw.q_per_channel_scales(), lin.weight)
            assert torch.equal(b, lin.bias)
    rep = quant.report(q)
    assert rep["mode"] == "dynamic" and {r["layer"] for r in rep["layers"]} == set(layers)
    for shape in [(16, 64), (2, 5, 64)]:
        x = _test_input(shape)
        with torch.no_grad():
            out, ref = q(x), model(x)
        assert out.shape == ref.shape
        assert cosine(out, ref) >= MIN_COSINE, shape
        assert not torch.equal(out, ref)


def test_quantize_dynamic_takes_linear_layers_only():
    model = small_cnn()
    q = quant.quantize_dynamic(model)
    rep = quant.report(q)
    assert [r["layer"] for r in rep["layers"]] == ["fc"]
    assert isinstance(q.fc, DynamicQuantizedLinear) and type(q.conv1) is nn.Conv2d
    fp32 = {f["layer"]: f["why"] for f in rep["fp32_layers"]}
    assert set(fp32) == {n for n, m in _layers(model).items() if isinstance(m, nn.Conv2d)}
    assert all("linear" in w for w in fp32.values())
    x = _test_input((2, 3, 16, 16))
    with torch.no_grad():
        assert cosine(q(x), model(x)) >= MIN_COSINE


@pytest.mark.parametrize("rows", [1, 8, 64], ids=lambda r: f"rows{r}")
def test_quantize_weight_only(rows):
    model = _mlp()
    q = quant.quantize_weight_only(model)
    for n, lin in _layers(model).items():
        m = q.get_submodule(n)
        assert isinstance(m, WeightOnlyLinear) and m.family == "weight_only"
        _check_int8_weight(m.wq, m.w_scales, lin.weight)
        assert "weight" not in dict(m.named_parameters())                # no fp32 copy of the weight kept
    assert quant.report(q)["mode"] == "weight_only"
    x = _test_input((rows, 64))
    with torch.no_grad():
        out, ref = q(x), model(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert cosine(out, ref) >= MIN_COSINE
    assert not torch.equal(out, ref)
    with torch.no_grad():                                               # bf16 activations too
        outb = q(x.bfloat16())
    assert outb.dtype == torch.bfloat16 and cosine(outb.float(), ref) >= MIN_COSINE


def test_weight_only_keeps_named_layers_fp32():
    model = _mlp()
    q = quant.quantize_weight_only(model, quant.QConfigMapping().set_global(quant.weight_only_qconfig())
                                   .set_module_name("6", None))
    assert type(q.get_submodule("6")) is nn.Linear and isinstance(q.get_submodule("0"), WeightOnlyLinear)
    assert "6" in {f["layer"] for f in quant.report(q)["fp32_layers"]}


# ------------------------------------------------------------------------------------- autotune
@pytest.mark.parametrize("name", list(MODELS))
def test_autotune_measures_and_picks_a_family(name):
    model, p, q, shape = _int8(name, n_batches=2, autotune=True)
    rep = quant.report(q)
    assert len(rep["layers"]) == len(_layers(model))
    for r in rep["layers"]:
        assert r["why"].startswith("measured"), r["why"]
        cands = [f for f in (K.LINEAR_KERNELS if r["kind"] == "linear" else K.CONV_KERNELS) if f != "torch"]
        assert r["family"] in cands
        # every candidate's time is stated, and the chosen one is the fastest stated
        times = {f: float(t.split()[0]) for f, t in (s.strip().split(" ", 1) for s in
                 r["why"].split(":", 1)[1].split(","))}
        assert set(times) <= set(cands) and r["family"] in times
        assert times[r["family"]] == min(times.values())
    x = _test_input(shape)
    with torch.no_grad():
        assert cosine(q(x), model(x)) >= MIN_COSINE


def test_sqnr_of_the_converted_mlp_is_stated():
    # the SQNR floor of the static MinMax int8 MLP (7-bit activations without VNNI): 25 dB
    model, p, q, shape = _int8("mlp")
    x = _test_input(shape)
    with torch.no_grad():
        s = sqnr_db(q(x), model(x))
    assert s >= 25.0, s
    with torch.no_grad():                                               # converted models deep-copy
        assert torch.equal(copy.deepcopy(q)(x), q(x))


def test_int8_generate_quantizes_every_call_structure():
    """optimize(dtype="int8").generate(): the prefill and decode plans (captured through generate's
    wrapper, whose module paths carry extra prefixes) really run int8 kernels, calibrated once."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0)
    model = T.GPT2LMHeadModel(cfg).eval()
    prompt = torch.randint(1, 500, (1, 16), generator=torch.Generator().manual_seed(1))
    calib = [{"input_ids": torch.randint(1, 500, (1, 16), generator=torch.Generator().manual_seed(i))}
             for i in range(3)]
    opt = cpu_opt.optimize(model, {"input_ids": prompt}, dtype="int8", calibration_data=calib)
    out = opt.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert out.shape == (1, 22)
    reports = opt._generation.reports()
    assert len(reports) == 2                                     # prefill and decode
    for r in reports:
        assert any("9 layer(s) quantized" in line for line in r["passes"]), r["passes"]
        assert "fell_back" not in r["validation"], r["validation"]


def test_optimize_int8_warns_when_nothing_is_quantized():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    mapping = quant.QConfigMapping().set_module_name("0", None)
    with pytest.warns(RuntimeWarning, match="no Linear/Conv2d layer"):
        opt = cpu_opt.optimize(model, (x,), dtype="int8", calibration_data=[(x,)], qconfig_mapping=mapping)
    assert opt.report()["int8"] == [] and opt.report()["int8_fp32_layers"]
    assert torch.allclose(opt(x), model(x), atol=1e-5)
