"""int8 accuracy on real models, on both paths: the module-level workflow (prepare / calibrate /
convert) and ``cpu_opt.optimize(..., dtype="int8", calibration_data=...)``.

Thresholds (the issue's "Accuracy (tests)"), against the fp32 model on a seeded input that is not
in the calibration data:

* cosine >= 0.99 on every floating-point output;
* SQNR >= SQNR_FLOOR_DB (22 dB) for the MLP and the transformers, >= CNN_SQNR_FLOOR_DB (17 dB, about
  what cosine 0.99 means) for the CNNs: random-weight CNNs accumulate quantization noise layer
  after layer, and without VNNI activations have 7 bits;
* CNN top-1 agreement with fp32 >= 98% over 512 seeded inputs;
* int8 kernels really ran: the report lists every quantized layer with its family, and the kernel
  calls counted during the forward match.

Models: the zoo (small sizes) and Hugging Face transformers in small random configs (the configs of
tests/optimize/test_hf_models.py, with the cache off). Transformers use the transformer preset:
SmoothQuant alpha 0.5 with MinMax activations, on both paths. CNNs and the MLP use the default static config
(histogram-calibrated activations; 256 bins to keep the range search cheap). The zoo's MobileNetV3
is left out: with random weights it is chaotic (a 40 dB perturbation of one early layer's output
leaves 18 dB at the logits), so no int8 scheme reaches cosine 0.99 on it.
"""
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_testutil import (REDUCE_RANGE, KernelCalls, buildable_families, call, compare, gen,  # noqa: E402
                            histogram_mapping, minmax_mapping, program_kernels, sqnr_db)

import cpu_opt  # noqa: E402
from cpu_opt import quant  # noqa: E402
from cpu_opt.models import ZOO  # noqa: E402
from cpu_opt.backends.amx_linear import kernel as amx_kernel  # noqa: E402
from cpu_opt.quant import kernels as K  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")

MIN_COSINE = 0.99
SQNR_FLOOR_DB = 22.0
CNN_SQNR_FLOOR_DB = 17.0
MIN_TOP1_AGREEMENT = 0.98
FAMILIES = ("fbgemm", "torch_onednn", "onednn", "amx")
N_CALIB = 4


# ------------------------------------------------------------------------------------- models
def _text(vocab, b, s, seed):
    g = gen(seed)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, : s // 4] = 0                               # left padding in the first row
    return {"input_ids": torch.randint(0, vocab, (b, s), generator=g), "attention_mask": mask}


def _pixels(b, seed, size=32):
    return {"pixel_values": torch.randn(b, 3, size, size, generator=gen(seed))}


def _hf():
    T = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore", module="transformers")
    return T


TEXT = dict(vocab_size=500, max_position_embeddings=64)
# name: (build, inputs(batch, seed), kind)
HF_CASES = {
    "hf_bert": (lambda T: T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=128, **TEXT)),
                lambda b, seed: _text(500, b, 16, seed), "transformer"),
    "hf_gpt2": (lambda T: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500,
                                                         n_positions=64, bos_token_id=0, eos_token_id=0,
                                                         use_cache=False)),
                lambda b, seed: _text(500, b, 16, seed), "transformer"),
    "hf_llama": (lambda T: T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128,
                                                            num_hidden_layers=2, num_attention_heads=4,
                                                            num_key_value_heads=2, use_cache=False, **TEXT)),
                 lambda b, seed: _text(500, b, 16, seed), "transformer"),
    "hf_vit": (lambda T: T.ViTModel(T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=128, image_size=32, patch_size=8)),
               lambda b, seed: _pixels(b, seed), "transformer"),
    "hf_convnext": (lambda T: T.ConvNextModel(T.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32],
                                                               depths=[1, 1])),
                    lambda b, seed: _pixels(b, seed), "cnn"),
    "hf_resnet": (lambda T: T.ResNetModel(T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                         layer_type="basic")),
                  lambda b, seed: _pixels(b, seed), "cnn"),
}


def _zoo_inputs(name):
    spec = ZOO[name]

    def inputs(b, seed):
        ex = spec.example_inputs(b, "small")
        g = gen(seed)
        if isinstance(ex, dict):                        # token ids in [1, vocab), the zoo's padding mask
            ids = torch.randint(1, 1000, ex["input_ids"].shape, generator=g)
            out = dict(ex, input_ids=ids * ex["attention_mask"] if "attention_mask" in ex else ids)
            return out
        return tuple(torch.randn(t.shape, generator=g) for t in ex)

    return inputs


ZOO_CASES = {
    "zoo_mlp": (lambda: ZOO["mlp"].build("small"), _zoo_inputs("mlp"), "mlp"),
    "zoo_bert": (lambda: ZOO["bert_base"].build("small"), _zoo_inputs("bert_base"), "transformer"),
    "zoo_vit": (lambda: ZOO["vit_b16"].build("small"), _zoo_inputs("vit_b16"), "transformer"),
}


def _case(name):
    if name in HF_CASES:
        make, inputs, kind = HF_CASES[name]
        T = _hf()
        torch.manual_seed(0)
        return make(T).eval(), inputs, kind
    make, inputs, kind = ZOO_CASES[name]
    return make(), inputs, kind


def _mapping(kind, path):
    if kind == "transformer":
        # SmoothQuant 0.5, MinMax, nn.Linear (+ HF Conv1D); the graph pass's SmoothQuant is broken
        return quant.transformer_qconfig_mapping(smoothquant_alpha=0.5)
    return histogram_mapping()


def _selected_layers(model, kind):
    """The layers the mapping should quantize: Linear (and HF Conv1D) always, Conv2d for CNN/MLP."""
    out = set()
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers")):
            out.add(n)
        elif isinstance(m, nn.Conv2d) and kind != "transformer":
            out.add(n)
    return out


class Result:
    pass


def _run(name):
    """Both paths on one model: outputs, reports, kernel calls during one forward each."""
    model, inputs, kind = _case(name)
    calib = [inputs(2, 100 + i) for i in range(N_CALIB)]
    x = inputs(2, 7)
    r = Result()
    r.model, r.inputs, r.kind, r.x = model, inputs, kind, x
    with torch.no_grad():
        r.ref = call(model, x)
    prepared = quant.prepare(model, _mapping(kind, "module"), calib[0])
    quant.calibrate(prepared, calib)
    r.qmodel = quant.convert(prepared)
    r.module_report = quant.report(r.qmodel)
    r.opt = cpu_opt.optimize(model, x, dtype="int8", calibration_data=calib, qconfig_mapping=_mapping(kind, "optimize"))
    r.opt_report = r.opt.report()
    with pytest.MonkeyPatch.context() as mp:
        calls = KernelCalls(mp)
        with torch.no_grad():
            r.module_out = call(r.qmodel, x)
        r.module_calls = dict(calls.calls)
        calls.reset()
        r.opt_out = call(r.opt, x)
        r.opt_calls = dict(calls.calls)
    return r


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _run(name)
        return cache[name]

    return get


ALL_CASES = list(ZOO_CASES) + list(HF_CASES)


def _floor(kind):
    return CNN_SQNR_FLOOR_DB if kind == "cnn" else SQNR_FLOOR_DB


@pytest.mark.parametrize("name", ALL_CASES)
def test_module_path_accuracy_and_kernels(name, results):
    r = results(name)
    cos, sqnr = compare(r.module_out, r.ref)
    assert cos >= MIN_COSINE, (name, cos, sqnr)
    assert sqnr >= _floor(r.kind), (name, cos, sqnr)
    assert type(r.module_out) is type(r.ref)
    rep = r.module_report
    layers = {li["layer"]: li for li in rep["layers"]}
    assert set(layers) == _selected_layers(r.model, r.kind), sorted(set(layers) ^ _selected_layers(r.model, r.kind))
    assert all(li["family"] in FAMILIES and li["why"] for li in layers.values())
    if r.kind == "transformer":
        assert all(li["smoothquant"] for li in layers.values() if li["kind"] == "linear")
    # each quantized layer ran its int8 kernel once in the forward, on the family the report names
    by_family = {}
    for li in layers.values():
        key = (li["family"], li["kind"])
        by_family[key] = by_family.get(key, 0) + 1
    assert r.module_calls == by_family, (r.module_calls, by_family)


@pytest.mark.parametrize("name", ALL_CASES)
def test_optimize_path_accuracy_and_kernels(name, results):
    r = results(name)
    rep = r.opt_report
    assert rep["dtype"] == "int8"
    v = rep["validation"]
    assert v["ok"] and "fell_back" not in v, v
    assert v["min_cosine"] >= MIN_COSINE and v["min_sqnr_db"] >= _floor(r.kind), v
    cos, sqnr = compare(r.opt_out, r.ref)
    assert cos >= MIN_COSINE, (name, cos, sqnr)
    assert sqnr >= _floor(r.kind), (name, cos, sqnr)
    assert type(r.opt_out) is type(r.ref)
    int8 = rep["int8"]
    assert int8, rep["passes"]
    assert {li["layer"] for li in int8} == _selected_layers(r.model, r.kind)
    for li in int8:
        assert set(li) >= {"layer", "node", "kind", "family", "why", "post_op", "residual_add", "smoothquant",
                           "in", "out"}
        assert li["family"] in FAMILIES and li["why"]
        assert li["in"] in ("fp32", "uint8 (chained)", "uint8 (from the LayerNorm before it)") and \
            li["out"] in ("fp32", "uint8 (chained)", "int8 (residual)")
        assert li["smoothquant"] is (r.kind == "transformer")   # the transformer preset's SmoothQuant
    calls = sum(r.opt_calls.values())
    assert calls == len(int8), (r.opt_calls, len(int8))
    assert {f for f, _ in r.opt_calls} == {li["family"] for li in int8}


def test_paths_agree_with_each_other(results):
    # same qconfig, same calibration data: the two paths' int8 answers differ (BatchNorm folding,
    # fused activations, chains) but are close
    for name in ("zoo_mlp", "hf_resnet"):
        r = results(name)
        cos, _ = compare(r.opt_out, r.module_out)
        assert cos >= MIN_COSINE, (name, cos)


def test_zoo_gpt2_linear_layers_are_quantized():
    model = ZOO["gpt2_small"].build("small")
    inputs = _zoo_inputs("gpt2_small")
    p = quant.calibrate(quant.prepare(model, quant.transformer_qconfig_mapping()), [inputs(2, 100 + i)
                                                                                   for i in range(2)])
    rep = quant.report(quant.convert(p))
    n_conv1d = sum(type(m).__name__ == "Conv1D" for m in model.modules())
    assert n_conv1d == 8
    names = {li["layer"] for li in rep["layers"]} | {f["layer"] for f in rep["fp32_layers"]}
    assert sum(n.endswith(("c_attn", "c_proj", "c_fc")) for n in names) == n_conv1d


# ------------------------------------------------------------------------------------- CNN top-1
IMG, CLASSES, SIGMA = 32, 10, 0.25


@pytest.fixture(scope="module")
def resnet_task():
    """The zoo's ResNet-18 (small: width 16; seeded random weights, calibrated BatchNorm) on a
    seeded 10-class task: class c's images are a fixed random prototype plus N(0, 0.25^2) noise;
    the fc head is the nearest-class-mean classifier on the network's features (fitted on 256
    separate seeded samples). A random network's own 100 logits are near-ties on random inputs
    (top-1 agreement there says nothing about int8: 8-bit fake quantization gets ~90%), so the
    head gives it decisions of the kind a trained network makes."""
    model = ZOO["resnet18"].build("small")
    protos = torch.randn(CLASSES, 3, IMG, IMG, generator=gen(5))

    def sample(n, seed):
        g = gen(seed)
        y = torch.randint(0, CLASSES, (n,), generator=g)
        return protos[y] + SIGMA * torch.randn(n, 3, IMG, IMG, generator=g), y

    model.fc = nn.Identity()
    with torch.no_grad():
        xs, ys = sample(256, 11)
        f = model(xs)
    mu = f.mean(0)
    w = torch.stack([f[ys == c].mean(0) - mu for c in range(CLASSES)])
    w = w / w.norm(dim=1, keepdim=True)
    model.fc = nn.Linear(f.shape[1], CLASSES)
    with torch.no_grad():
        model.fc.weight.copy_(w)
        model.fc.bias.copy_(-(w @ mu))
    calib = [(sample(16, 100 + i)[0],) for i in range(N_CALIB)]        # separate seeds from the evaluation
    evals = [sample(64, 1000 + i) for i in range(8)]                   # 512 inputs, batches of 64
    with torch.no_grad():
        refs = [model(x) for x, _ in evals]
    mapping = histogram_mapping()
    prepared = quant.calibrate(quant.prepare(model, mapping), calib)
    qmodel = quant.convert(prepared)
    opt = cpu_opt.optimize(model, (evals[0][0],), dtype="int8", calibration_data=calib, qconfig_mapping=mapping)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    q_onednn = quant.convert(prepared, families={n: "torch_onednn" for n in names})
    with torch.no_grad():
        outs = {"module": [qmodel(x) for x, _ in evals], "optimize": [opt(x) for x, _ in evals],
                "module_torch_onednn": [q_onednn(x) for x, _ in evals]}
    return dict(model=model, evals=evals, refs=refs, outs=outs, qmodel=qmodel, opt=opt)


def test_resnet_task_is_meaningful_in_fp32(resnet_task):
    acc = sum((r.argmax(1) == y).sum().item() for r, (_, y) in zip(resnet_task["refs"], resnet_task["evals"])) / 512
    assert acc >= 0.95, acc




@pytest.mark.parametrize("path", [
    "module",
    "module_torch_onednn", "optimize"])
def test_cnn_top1_agreement_cosine_and_sqnr(path, resnet_task):
    outs, refs = resnet_task["outs"][path], resnet_task["refs"]
    agree = sum((o.argmax(1) == r.argmax(1)).sum().item() for o, r in zip(outs, refs)) / 512
    cos, sqnr = compare(torch.cat(outs), torch.cat(refs))
    assert agree >= MIN_TOP1_AGREEMENT, (agree, cos, sqnr)
    assert cos >= MIN_COSINE, (agree, cos, sqnr)
    assert sqnr >= CNN_SQNR_FLOOR_DB, (agree, cos, sqnr)


def test_resnet_optimize_report_fuses_chains_and_adds_residuals(resnet_task):
    rep = resnet_task["opt"].report()
    int8 = rep["int8"]
    convs = [li for li in int8 if li["kind"] == "conv2d"]
    assert len(convs) == sum(isinstance(m, nn.Conv2d) for m in resnet_task["model"].modules())
    # 8 basic blocks, one residual add (+ the ReLU after it) fused into a convolution each: conv2
    # in the identity blocks, the shortcut's 1x1 convolution in the 3 downsampling ones (the
    # first convolution of "conv + conv" in graph order takes the add)
    res = [li for li in convs if li["residual_add"]]
    assert len(res) == 8 and all(li["post_op"] == "relu" for li in res)
    assert sorted(li["layer"] for li in res if li["layer"].endswith("downsample.0")) == \
        [f"layer{i}.0.downsample.0" for i in (2, 3, 4)]
    assert len({li["layer"].rsplit(".", 2)[0] if "downsample" in li["layer"] else li["layer"].rsplit(".", 1)[0]
                for li in res}) == 8                                  # one per block
    # conv1 of every block: BatchNorm folded, ReLU fused, uint8 straight into conv2
    firsts = [li for li in convs if li["layer"].endswith(".conv1")]
    assert len(firsts) == 8
    assert all(li["post_op"] == "relu" and li["out"] == "uint8 (chained)" for li in firsts)
    assert all(li["in"] == "uint8 (chained)" for li in convs if li["layer"].endswith(".conv2"))
    assert [li["layer"] for li in int8 if li["kind"] == "linear"] == ["fc"]


# ------------------------------------------------------------------------------------- SmoothQuant
class OutlierBlock(nn.Module):
    """A pre-LN transformer MLP block plus a projection, whose LayerNorm weight has four channels
    x50: the activation outliers of LLMs, which per-tensor static int8 cannot represent. As in a
    trained LLM the outliers carry no more signal than the other channels: the next layers'
    weights for them are /10."""

    def __init__(self, d=64, h=192):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.proj = nn.Linear(d, d)
        self.fc2 = nn.Linear(h, d)
        idx = torch.tensor([3, 17, 40, 58])
        with torch.no_grad():
            self.ln.weight[idx] *= 50.0
            self.fc1.weight[:, idx] /= 10.0
            self.proj.weight[:, idx] /= 10.0

    def forward(self, x):
        h = self.ln(x)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h))) + self.proj(h)


@pytest.fixture(scope="module")
def outlier_model():
    torch.manual_seed(0)
    model = OutlierBlock().eval()
    calib = [(torch.randn(4, 16, 64, generator=gen(200 + i)),) for i in range(N_CALIB)]
    x = torch.randn(4, 16, 64, generator=gen(9))
    with torch.no_grad():
        ref = model(x)
    return model, calib, x, ref


@pytest.mark.parametrize("path", ["module", "optimize"])
def test_smoothquant_beats_plain_static_on_outlier_channels(path, outlier_model):
    model, calib, x, ref = outlier_model
    sq = {}
    for alpha in (0.5, None):
        mapping = quant.transformer_qconfig_mapping(smoothquant_alpha=alpha)
        if path == "module":
            q = quant.convert(quant.calibrate(quant.prepare(model, mapping), calib))
            rows = quant.report(q)["layers"]
            with torch.no_grad():
                out = q(x)
        else:
            opt = cpu_opt.optimize(model, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=mapping)
            v = opt.report()["validation"]
            if alpha is None and "first_try" in v:
                # plain static int8 with 7-bit activations (no VNNI) is too far off here (cosine 0.964 <
                # INT8_MIN_COSINE): optimize keeps the layers with the largest own error in fp32 until it
                # passes, and says so; the SQNR of the all-int8 plan it measured first is in the report.
                # With VNNI's 8-bit activations it passes at once (cosine 0.990, 17 dB on a Xeon with AMX)
                assert "fell_back" not in v and v["first_try"]["min_cosine"] < 0.97, v
                assert v["ok"] and v["int8_layers_in_fp32"], v
                sq[alpha] = v["first_try"]["min_sqnr_db"]
                continue
            assert "fell_back" not in v, v
            rows = opt.report()["int8"]
            out = opt(x)
        assert {li["layer"] for li in rows} == {"fc1", "fc2", "proj"}
        assert all(li["smoothquant"] is (alpha is not None) for li in rows), rows
        sq[alpha] = sqnr_db(out, ref)
    # SmoothQuant moves the x50 channels into the weights: measurably better (33 vs 11 dB with 7-bit
    # activations on a Zen 3, 34.5 vs 17 dB with 8-bit ones on a Xeon with AMX)
    assert sq[0.5] >= sq[None] + 10.0, sq
    assert sq[0.5] >= SQNR_FLOOR_DB, sq


def test_optimize_smoothquant_single_linear():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32)).eval()
    calib = [(torch.randn(8, 32, generator=gen(600 + i)),) for i in range(N_CALIB)]
    x = torch.randn(8, 32, generator=gen(12))
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib,
                           qconfig_mapping=quant.transformer_qconfig_mapping(smoothquant_alpha=0.5))
    assert opt.report()["int8"][0]["smoothquant"] is True
    with torch.no_grad():
        cos, sqnr = compare(opt(x), m(x))
    assert cos >= MIN_COSINE and sqnr >= SQNR_FLOOR_DB, (cos, sqnr)       # today: 0.92, -2 dB


# ------------------------------------------------------------------------------------- optimize specifics
def test_optimize_mlp_fuses_activations_and_chains_layers(results):
    r = results("zoo_mlp")
    rows = r.opt_report["int8"]
    assert [li["layer"] for li in rows] == ["0", "2", "4", "6"]
    assert [li["post_op"] for li in rows] == ["relu", "gelu_erf", "silu", None]
    assert [li["out"] for li in rows] == ["uint8 (chained)"] * 3 + ["fp32"]
    assert [li["in"] for li in rows] == ["fp32"] + ["uint8 (chained)"] * 3
    assert not any(li["residual_add"] for li in rows)
    # the module path keeps the activations outside (the model's code is not rewritten)
    assert all(li["post_op"] is None for li in r.module_report["layers"])


def with_bn_statistics(m: nn.Module) -> nn.Module:
    """``m`` in eval mode with running statistics of its BatchNorms that are not the identity."""
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.1, 0.1)
                bn.running_var.uniform_(0.5, 1.5)
    return m.eval()


class ResBlock(nn.Module):
    """A ResNet basic block with a downsampling shortcut, then a classifier."""

    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(c)
        self.conv1 = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(2 * c)
        self.conv2 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * c)
        self.down = nn.Conv2d(c, 2 * c, 1, stride=2, bias=False)
        self.bnd = nn.BatchNorm2d(2 * c)
        self.fc = nn.Linear(2 * c, 10)

    def forward(self, x):
        x = torch.relu(self.bn0(self.stem(x)))
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y)) + self.bnd(self.down(x))
        return self.fc(torch.relu(y).mean((2, 3)))


@pytest.fixture(scope="module")
def resblock():
    torch.manual_seed(0)
    m = with_bn_statistics(ResBlock())
    calib = [(torch.randn(4, 3, 16, 16, generator=gen(300 + i)),) for i in range(N_CALIB)]
    x = torch.randn(2, 3, 16, 16, generator=gen(8))
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    return m, calib, x, opt


def test_optimize_resnet_block_fuses_the_residual_add(resblock, monkeypatch):
    m, calib, x, opt = resblock
    rep = opt.report()
    rows = {li["layer"]: li for li in rep["int8"]}
    assert set(rows) == {"stem", "conv1", "conv2", "down", "fc"}
    # conv2 + BN + add + ReLU is one kernel call (the shortcut's output arrives as its residual)
    assert rows["conv2"]["residual_add"] is True and rows["conv2"]["post_op"] == "relu"
    assert [n for n, li in rows.items() if li["residual_add"]] == ["conv2"]
    assert rows["conv1"]["post_op"] == "relu" and rows["conv1"]["out"] == "uint8 (chained)"
    assert rows["conv2"]["in"] == "uint8 (chained)"
    assert rows["stem"]["out"] == "uint8 (chained)"             # feeds conv1 and down, with one scale
    assert rows["down"]["in"] == "uint8 (chained)"
    assert "fell_back" not in rep["validation"]
    calls = KernelCalls(monkeypatch)
    out = opt(x)
    assert calls.total() == 5
    with torch.no_grad():
        ref = m(x)
    cos, sqnr = compare(out, ref)
    assert cos >= MIN_COSINE and sqnr >= CNN_SQNR_FLOOR_DB, (cos, sqnr)


class HardSwishBlock(nn.Module):
    """MobileNetV3's pattern: convolutions with HardSwish, a depthwise one among them, a pointwise one
    whose output adds the block's input before its HardSwish, and a squeeze-excitation scale
    (hardsigmoid(s) * x) before the classifier."""

    def __init__(self, c=16):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.dw, self.bn1 = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c)
        self.pw, self.bn2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.se = nn.Conv2d(c, c, 1)
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        x = nn.functional.hardswish(self.bn0(self.stem(x)))
        y = nn.functional.hardswish(self.bn1(self.dw(x)))
        x = nn.functional.hardswish(self.bn2(self.pw(y)) + x)
        x = nn.functional.hardsigmoid(self.se(x.mean((2, 3), keepdim=True))) * x
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("family", ["fbgemm", "torch_onednn", "onednn"])
def test_optimize_int8_fuses_hardswish_and_chains_uint8(family, monkeypatch):
    """HardSwish runs inside the int8 convolution on every family (fused where it has it, after the
    kernel where not), after a residual add where there is one, and the uint8 output feeds the next
    int8 layer; before, MobileNetV3's int8 convolutions wrote float32 for a HardSwish partition and
    were quantized again, and its int8 model was slower than its fp32 one. Answers within the CNN
    bounds."""
    from cpu_opt.quant import api

    assert family in buildable_families("conv2d")
    from cpu_opt.backends.fbgemm import depthwise_saturates

    # with 8-bit activations (VNNI) FBGEMM cannot take the depthwise layer (choose_family's rule):
    # forced to FBGEMM, it stays on torch's oneDNN, and its uint8 still chains across the families
    dw_family = "torch_onednn" if family == "fbgemm" and depthwise_saturates((16, 1, 3, 3), 16, (1, 1)) else family

    def forced(kind, rows, macs, conv=None, **_):
        if kind != "conv2d":
            return "fbgemm", "forced"
        return (dw_family if conv is not None and depthwise_saturates(*conv) else family), "forced"

    monkeypatch.setattr(api, "choose_family", forced)
    torch.manual_seed(0)
    m = with_bn_statistics(HardSwishBlock())
    calib = [(torch.randn(4, 3, 16, 16, generator=gen(700 + i)),) for i in range(N_CALIB)]
    x = torch.randn(2, 3, 16, 16, generator=gen(9))
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    rows = {li["layer"]: li for li in opt.report()["int8"]}
    assert {k: rows[k]["family"] for k in ("stem", "dw", "pw", "se")} == \
        {"stem": family, "dw": dw_family, "pw": family, "se": family}, rows
    assert rows["stem"]["post_op"] == "hardswish" and rows["stem"]["out"] == "uint8 (chained)", rows
    assert rows["dw"]["post_op"] == "hardswish" and rows["dw"]["in"] == "uint8 (chained)", rows
    assert rows["pw"]["post_op"] == "hardswish" and rows["pw"]["residual_add"] is True, rows
    assert [k for k, li in rows.items() if li["residual_add"]] == ["pw"]
    assert "fell_back" not in opt.report()["validation"]
    calls = KernelCalls(monkeypatch)
    out = opt(x)
    assert calls.total() == len(rows)
    with torch.no_grad():
        ref = m(x)
    cos, sqnr = compare(out, ref)
    assert cos >= MIN_COSINE and sqnr >= CNN_SQNR_FLOOR_DB, (family, cos, sqnr)


@pytest.mark.parametrize("batch", [1, 5])
def test_optimize_int8_second_input_shape(batch, resblock, results):
    m, calib, x, opt = resblock
    x2 = torch.randn(batch, 3, 16, 16, generator=gen(40 + batch))
    out = opt(x2)
    with torch.no_grad():
        ref = m(x2)
    assert out.shape == ref.shape
    cos, sqnr = compare(out, ref)
    assert cos >= MIN_COSINE and sqnr >= CNN_SQNR_FLOOR_DB, (cos, sqnr)
    rep = opt.report()
    assert rep["shapes_compiled"] >= 2
    assert all(c["ok"] for c in rep["shape_validation"]), rep["shape_validation"]
    # a transformer at a new batch and sequence length too
    r = results("hf_bert")
    x3 = r.inputs(3, 55)
    x3 = {k: v[:, :12] for k, v in x3.items()}
    out3 = call(r.opt, x3)
    with torch.no_grad():
        ref3 = call(r.model, x3)
    cos, sqnr = compare(out3, ref3)
    assert cos >= MIN_COSINE and sqnr >= SQNR_FLOOR_DB, (cos, sqnr)


def test_optimize_int8_needs_calibration_data():
    m = ZOO["mlp"].build("small")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="calibration_data"):
        cpu_opt.optimize(m, (x,), dtype="int8")
    with pytest.raises(ValueError, match="empty"):
        cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=[])
    with pytest.raises(ValueError, match="dtype='int8'"):
        cpu_opt.optimize(m, (x,), dtype="fp32", calibration_data=[(x,)])
    with pytest.raises(TypeError, match="QConfigMapping"):
        cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=[(x,)], qconfig_mapping={"": None})


def test_optimize_int8_fallback_is_not_silently_wrong(monkeypatch):
    m = ZOO["mlp"].build("small")
    calib = [(torch.randn(8, 64, generator=gen(700 + i)),) for i in range(2)]
    x = torch.randn(8, 64, generator=gen(13))

    def broken(self, x, other=None):            # an int8 kernel that returns garbage
        return torch.zeros(self.out_shape(tuple(x.shape)),
                           dtype=torch.uint8 if self.out_qparams is not None else torch.float32)

    for cls in {*K.LINEAR_KERNELS.values(), *K.CONV_KERNELS.values()}:
        monkeypatch.setattr(cls, "run", broken)
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    v = opt.report()["validation"]
    assert v["min_cosine"] < 0.97 and "fell_back" in v, v             # the broken plan was caught
    with torch.no_grad():
        ref = m(x)
    cos, _ = compare(opt(x), ref)
    assert cos >= 0.97, cos                                             # and is not what runs


class _Crushing(nn.Module):
    """fc2's input has one channel 1000x the others that fc2 ignores (zero weights): per-tensor
    activation quantization rounds every channel fc2 does use to zero. fc1 and fc3 quantize well."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        with torch.no_grad():
            self.fc1.weight[7].zero_()
            self.fc1.bias[7] = 1000.0
            self.fc2.weight[:, 7] = 0.0

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_optimize_int8_keeps_only_the_layer_that_breaks_accuracy_in_fp32(monkeypatch):
    m = _Crushing().eval()
    calib = [(torch.randn(16, 32, generator=gen(900 + i)),) for i in range(3)]
    x = torch.randn(16, 32, generator=gen(5))
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    calls = KernelCalls(monkeypatch)
    with torch.no_grad():
        out = opt(x)
    v = opt.report()["validation"]
    assert v["first_try"]["min_cosine"] < 0.97, v                      # all in int8: broken
    assert v["ok"] and "fell_back" not in v, v
    assert [r["layer"] for r in v["int8_layers_in_fp32"]] == ["fc2"], v  # the worst layer, and only it
    assert v["int8_layers_in_fp32"][0]["sqnr_db"] < 10, v
    rep = opt.report()
    assert {r["layer"] for r in rep["int8"]} == {"fc1", "fc3"}, rep["int8"]
    assert any("fc2" in w["why"] and "kept in fp32 by validation" in w["why"] for w in rep["int8_fp32_layers"])
    assert calls.total() >= 2                                            # fc1 and fc3 ran int8 kernels
    with torch.no_grad():
        ref = m(x)
    cos, _ = compare(out, ref)
    assert cos >= 0.97, cos


class _Outlier(_Crushing):
    """_Crushing with a milder outlier channel (MILD x the others): all in int8 the outputs stay above
    the kernels' guard (cosine 0.97) but below a stricter accuracy a user may ask for."""

    MILD = 40.0

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.fc1.bias[7] = self.MILD


def test_optimize_int8_min_cosine_keeps_the_worst_layers_in_fp32_until_it_holds(monkeypatch):
    """min_cosine: the accuracy the user holds the int8 model to. The default keeps every layer in int8
    (only the guard against broken kernels); a stricter min_cosine keeps the layer with the largest
    int8 error in fp32, and only it, and the outputs then reach it."""
    m = _Outlier().eval()
    calib = [(torch.randn(16, 32, generator=gen(900 + i)),) for i in range(3)]
    x = torch.randn(16, 32, generator=gen(5))
    with torch.no_grad():
        ref = m(x)
    loose = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    v = loose.report()["validation"]
    assert v["ok"] and "int8_layers_in_fp32" not in v, v
    cos_all, _ = compare(loose(x), ref)
    assert 0.97 <= cos_all < 0.999, cos_all
    strict = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping(),
                              min_cosine=0.999)
    v = strict.report()["validation"]
    assert v["ok"] and "fell_back" not in v, v
    assert v["first_try"]["min_cosine"] == pytest.approx(cos_all, abs=1e-6), v
    assert [r["layer"] for r in v["int8_layers_in_fp32"]] == ["fc2"], v
    assert {r["layer"] for r in strict.report()["int8"]} == {"fc1", "fc3"}
    calls = KernelCalls(monkeypatch)
    cos, _ = compare(strict(x), ref)
    assert cos >= 0.999 and calls.total() == 2, (cos, calls.calls)
    x2 = torch.randn(5, 32, generator=gen(6))          # a new shape is held to it too
    cos2, _ = compare(strict(x2), m(x2).detach())
    assert cos2 >= 0.999, cos2
    checks = strict.report()["shape_validation"]
    assert [c["shapes"] for c in checks] == [[[5, 32]]] and checks[0]["ok"], checks


def test_optimize_int8_min_cosine_out_of_reach_runs_cpu_opts_fp32_plan():
    """A bar no int8 subset reaches (1.0: only fp32 is exact) while all-int8 is above the 0.97 guard:
    that is quantization noise, not a broken kernel, so the model runs as cpu_opt's fp32 plan (oneDNN
    on), not in eager torch, and says so."""
    m = _Outlier().eval()
    calib = [(torch.randn(16, 32, generator=gen(900 + i)),) for i in range(3)]
    x = torch.randn(16, 32, generator=gen(5))
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping(),
                           min_cosine=1.0)
    v = opt.report()["validation"]
    assert v["fell_back"].endswith("the model runs in cpu_opt's fp32 plan"), v
    assert opt._options["use_onednn"] and not opt.report().get("int8"), opt.report().get("int8")
    with torch.no_grad():
        assert torch.allclose(opt(x), m(x), rtol=1e-4, atol=1e-5)


def test_optimize_int8_new_shape_below_min_cosine_runs_in_fp32(monkeypatch):
    """Each new shape's first call is held to min_cosine, also when the int8 plan has no oneDNN
    partition (its int8 kernels run outside them); a shape that misses it runs in fp32, reported."""
    m = _Outlier().eval()
    calib = [(torch.randn(16, 32, generator=gen(900 + i)),) for i in range(3)]
    x = torch.randn(16, 32, generator=gen(5))
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    assert opt.report()["validation"]["ok"] and opt.report()["int8"]
    opt._options["int8"][1].min_cosine = 1.0    # a bar the int8 plan of any new shape misses
    x2 = torch.randn(5, 32, generator=gen(6))
    with torch.no_grad():
        y2, ref2 = opt(x2), m(x2)
    [check] = opt.report()["shape_validation"]
    assert check["shapes"] == [[5, 32]] and not check["ok"] and check["min_cosine"] < 1.0, check
    assert "runs in fp32" in check["fell_back"], check
    assert torch.allclose(y2, ref2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -0.5, 0.5, 0.969, 1.5, True, "0.99", float("nan")])
def test_optimize_min_cosine_must_be_a_cosine(bad):
    m = _Outlier().eval()
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="min_cosine must be a number from 0.97 to 1"):
        cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=[(x,)], min_cosine=bad)


def test_optimize_min_cosine_needs_int8_and_validation():
    import numpy as np

    m = _Outlier().eval()
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="^min_cosine: for dtype='int8' only"):
        cpu_opt.optimize(m, (x,), dtype="fp32", min_cosine=0.99)
    with pytest.raises(ValueError, match="min_cosine needs validate=True"):
        cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=[(x,)], min_cosine=0.99, validate=False)
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=[(x,)], min_cosine=np.float32(0.98))
    assert opt.report()["validation"]["ok"]


@pytest.mark.parametrize("bad", ["two_tensors", "dict", "rank", "dtype"])
def test_optimize_int8_refuses_calibration_items_of_another_structure(bad):
    m = ZOO["mlp"].build("small")
    x = torch.randn(2, 64)
    item = {"two_tensors": (x, x), "dict": {"x": x}, "rank": (torch.randn(2, 3, 64),),
            "dtype": (x.double(),)}[bad]
    with pytest.raises(ValueError, match="calibration item 1"):
        cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=[(x,), item])


def test_optimize_int8_on_each_family(monkeypatch):
    """Routing sends everything to one family on a given machine; forcing each family in turn
    runs the graph form (fused activations, uint8 chains, residual) on every kernel that builds."""
    from cpu_opt.quant import api

    families = {"linear": buildable_families("linear"), "conv2d": buildable_families("conv2d")}
    assert {"fbgemm", "torch_onednn"} <= set(families["linear"])
    assert set(families["conv2d"]) == {"fbgemm", "torch_onednn", "onednn"}
    torch.manual_seed(0)
    mlp = ZOO["mlp"].build("small")
    mlp_calib = [(torch.randn(8, 64, generator=gen(400 + i)),) for i in range(N_CALIB)]
    xm = torch.randn(8, 64, generator=gen(10))
    blk = ResBlock().eval()
    blk_calib = [(torch.randn(2, 3, 16, 16, generator=gen(500 + i)),) for i in range(N_CALIB)]
    xb = torch.randn(2, 3, 16, 16, generator=gen(11))
    for i, lin in enumerate(families["linear"]):
        conv = families["conv2d"][i % len(families["conv2d"])]
        monkeypatch.setattr(api, "choose_family",
                            lambda kind, rows, macs, conv=None, lin=lin, conv_fam=conv, **_:
                            (lin if kind == "linear" else conv_fam, "forced"))
        for model, calib, x in ((mlp, mlp_calib, xm), (blk, blk_calib, xb)):
            opt = cpu_opt.optimize(model, (x,), dtype="int8", calibration_data=calib,
                                   qconfig_mapping=minmax_mapping())
            rows = opt.report()["int8"]
            assert {(li["kind"], li["family"]) for li in rows} <= {("linear", lin), ("conv2d", conv)}
            assert any(li["out"] == "uint8 (chained)" for li in rows)
            with pytest.MonkeyPatch.context() as mp:
                calls = KernelCalls(mp)
                out = opt(x)
            assert set(calls.calls) == {(li["family"], "linear" if li["kind"] == "linear" else "conv2d")
                                        for li in rows}
            with torch.no_grad():
                ref = model(x)
            cos, sqnr = compare(out, ref)
            assert cos >= MIN_COSINE and sqnr >= CNN_SQNR_FLOOR_DB, (lin, conv, type(model).__name__, cos, sqnr)
            assert "fell_back" not in opt.report()["validation"]


def test_reduce_range_follows_the_cpu():
    # the kernels' exactness (tests/quant/test_int8_kernels.py) relies on 7-bit activations
    # where the CPU has no VNNI; the presets must pick that here
    from cpu_opt.platform import hw

    assert REDUCE_RANGE == (not hw.has_vnni(hw.detect()))
    obs = quant.default_qconfig_mapping().qconfig_for("x", nn.Linear(2, 2)).activation()
    assert obs.reduce_range == REDUCE_RANGE
    assert K.activation_qmax() == (127 if REDUCE_RANGE else 255)


# ------------------------------------------------------------------------------------- pooling in a chain, reused outputs
def test_resnet_stem_chains_through_the_max_pool(resnet_task):
    """The stem convolution writes uint8 with the next convolution's input scale and the max-pool
    between them runs on the bytes (max commutes with quantization): no dequantize / quantize
    around it, and the pooled bytes are exactly the quantized pooled values."""
    opt = resnet_task["opt"]
    rows = {li["layer"]: li for li in opt.report()["int8"]}
    assert rows["conv1"]["out"] == "uint8 (chained)"
    assert rows["layer1.0.conv1"]["in"] == "uint8 (chained)"
    prog = next(iter(opt._plans.values())).program
    pools = [k for k, _ in program_kernels(prog) if type(k).__name__ == "MaxPool2dU8"]
    assert len(pools) == 1
    x = torch.randint(0, 256, (2, 4, 9, 9), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    ref = torch.nn.functional.max_pool2d(x.float(), *pools[0].args)
    assert torch.equal(pools[0](x).float(), ref)


class _TwoOutputs(nn.Module):
    """Returns an int8 layer's output itself and a narrow view of another: both escape to the caller."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        a = torch.relu(self.c1(x))
        b = torch.relu(self.c2(a))
        c = self.c3(b)
        return c, b.narrow(1, 0, 4) + 0.0, torch.relu(self.c2(a)).narrow(2, 0, 3)


def test_reused_int8_outputs_never_reach_the_caller():
    """Layers whose outputs stay inside the graph reuse one buffer per thread across calls; an
    output the caller gets (itself or through a view) is new on every call: the first call's
    results do not change when the model is called again."""
    torch.manual_seed(0)
    m = _TwoOutputs().eval()
    calib = [(torch.randn(2, 3, 8, 8, generator=gen(900 + i)),) for i in range(N_CALIB)]
    opt = cpu_opt.optimize(m, (calib[0][0],), dtype="int8", calibration_data=calib,
                           qconfig_mapping=minmax_mapping())
    plan = next(iter(opt._plans.values()))
    prog = plan.program
    kernels = program_kernels(prog)   # chained or not
    assert len(kernels) >= 3
    if plan.lowered is not None:   # the runtime's program (oneDNN is used at this ISA)
        assert any(k.reuse_output for k, _ in kernels)      # inside-only outputs are reused ...
    assert any(returned for _, returned in kernels)
    assert not any(k.reuse_output for k, returned in kernels if returned)   # ... returned ones are not
    x1, x2 = torch.randn(2, 3, 8, 8, generator=gen(1)), torch.randn(2, 3, 8, 8, generator=gen(2))
    first = opt(x1)
    kept = [t.clone() for t in first]
    second = opt(x2)
    for a, b, c in zip(first, kept, second):
        assert torch.equal(a, b)                                  # unchanged by the second call
        assert not torch.equal(a, c)
    with torch.no_grad():
        for got, ref in zip(opt(x1), m(x1)):
            cos, _ = compare(got, ref)
            assert cos >= MIN_COSINE, cos


class _ChainNet(nn.Module):
    """A ResNet-like stem and blocks: convolution -> max-pool -> two convolutions with the residual
    -> a strided convolution plus a 1x1 shortcut -> a 1x1 convolution; the first block's output is
    also returned."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.a = nn.Conv2d(16, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1)
        self.c = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.down = nn.Conv2d(16, 32, 1, stride=2)
        self.e = nn.Conv2d(32, 32, 1)

    def forward(self, x):
        s = self.pool(torch.relu(self.stem(x)))
        h = torch.relu(self.b(torch.relu(self.a(s))) + s)
        y = torch.relu(self.c(h) + self.down(h))   # c: uint8 out, down's int8 shortcut summed in place
        return self.e(y).mean((2, 3)), h


@pytest.mark.isa
def test_int8_convolutions_run_as_a_bound_chain_of_primitives(monkeypatch):
    """Consecutive int8 convolutions and the uint8 max-pool on cpu_opt's oneDNN binding run as
    PrimitiveChain steps where the CPU has VNNI (uint8 outputs need no clamp there): bound once, no
    layer's Python per call. The answers are bit for bit the layer-by-layer path's, a returned
    output is new on every call, and two threads can call the model at once. Without VNNI (or without
    the binding) there is no chain and the layers run one by one."""
    import threading

    from cpu_opt.backends.int8 import activation_qmax
    from cpu_opt.backends.onednn_primitives import DnnlConv2d, PrimitiveChain
    from cpu_opt.quant import api

    onednn = "onednn" in buildable_families("conv2d")
    if onednn:
        monkeypatch.setattr(api, "choose_family", lambda kind, rows, macs, conv=None, **_: ("onednn", "forced"))
    torch.manual_seed(0)
    m = _ChainNet().eval()
    calib = [(torch.randn(2, 3, 32, 32, generator=gen(950 + i)),) for i in range(N_CALIB)]
    opt = cpu_opt.optimize(m, (calib[0][0],), dtype="int8", calibration_data=calib,
                           qconfig_mapping=minmax_mapping())
    plan = next(iter(opt._plans.values()))
    chains = [n.target for n in plan.program.graph.nodes if isinstance(n.target, PrimitiveChain)]
    chained = any("run as" in line and "chain" in line for line in opt.report()["passes"])
    x1, x2 = torch.randn(2, 3, 32, 32, generator=gen(1)), torch.randn(2, 3, 32, 32, generator=gen(2))
    with torch.no_grad():
        ref1, ref2 = m(x1), m(x2)
    if not (onednn and activation_qmax() == 255 and plan.lowered is not None):
        assert not chains and not chained and opt.report()["counts"]["primitive_chains"] == 0
        for got, ref in zip(opt(x1), ref1):
            assert compare(got, ref)[0] >= MIN_COSINE
        return
    assert chains and chained
    rep = opt.report()
    assert rep["counts"]["primitive_chains"] == len(chains) == len(rep["primitive_chains"])
    assert rep["counts"]["chained_primitives"] == sum(len(c.members) for c in chains)
    members = [k for c in chains for k, _src, _other in c.members]
    assert len(chains) == 2   # split where a float output (the returned block output) is quantized again
    assert sum(isinstance(k, DnnlConv2d) for k in members) == 6 and sum(type(k).__name__ == "MaxPool2dU8"
                                                                        for k in members) == 1
    runs = []
    real_run = DnnlConv2d.run
    monkeypatch.setattr(DnnlConv2d, "run", lambda self, *a: runs.append(self) or real_run(self, *a))
    first = opt(x1)
    assert not runs                       # the bound chain ran its members: no layer-by-layer call
    bound = [f for c in chains for f in c.bindings().values()]
    assert bound and all(f is not None for f in bound)
    # the shortcut's int8 output is summed in place by the layer that adds it (its last reader)
    assert sum(len(f.in_place) for f in bound) == 1
    kept = [t.clone() for t in first]
    second = opt(x2)
    for a, b, c in zip(first, kept, second):
        assert torch.equal(a, b) and not torch.equal(a, c)   # returned outputs are new on every call
    for got, ref in zip(first, ref1):
        assert compare(got, ref)[0] >= MIN_COSINE

    # the layer-by-layer path (a thread whose chains cannot bind) gives the same bits
    step = {}
    monkeypatch.setattr(PrimitiveChain, "_bind", lambda self, inputs: None)
    t = threading.Thread(target=lambda: step.update(a=opt(x1), b=opt(x2)))
    t.start()
    t.join()
    monkeypatch.undo()
    assert runs                           # ... it did run layer by layer
    for a, b in zip(step["a"], kept):
        assert torch.equal(a, b)
    for a, b in zip(step["b"], second):
        assert torch.equal(a, b)

    # a chain that cannot bind (here: made to fail) runs layer by layer and says why
    def refuse(self, inputs):
        raise RuntimeError("no binding in this test")

    monkeypatch.setattr(PrimitiveChain, "_bind", refuse)
    t = threading.Thread(target=lambda: step.update(c=opt(x1)))
    t.start()
    t.join()
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(step["c"], kept))
    assert all("no binding in this test" in why for c in chains for why in c.unbound.values())
    assert all(c.unbound for c in chains)
    assert all(ch["unbound"] and "no binding" in ch["unbound"][0]["why"] for ch in opt.report()["primitive_chains"])

    # two threads at once, each with its own bound buffers
    got, errors = {}, []

    def worker(k, x):
        try:
            got[k] = [opt(x) for _ in range(20)]
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k, x)) for k, x in ((1, x1), (2, x2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, want in ((1, kept), (2, second)):
        for outs in got[k]:
            assert all(torch.equal(a, b) for a, b in zip(outs, want))

    # served at many batch sizes, a chain keeps the bindings of the most recent signatures only
    with torch.no_grad():
        for b in range(1, PrimitiveChain.MAX_BINDINGS + 4):
            x = torch.randn(b, 3, 32, 32, generator=gen(60 + b))
            for got, ref in zip(plan.program(x), m(x)):
                assert compare(got, ref)[0] >= MIN_COSINE
            assert all(len(c.bindings()) <= PrimitiveChain.MAX_BINDINGS for c in chains)
    assert all(len(c.bindings()) == PrimitiveChain.MAX_BINDINGS for c in chains)
    assert all(f is not None for c in chains for f in c.bindings().values())


class _QKV(nn.Module):
    """A self-attention block: three projections of one input, attention, an output projection and
    the residual: what the query/key/value merge is for."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads = heads

    def forward(self, x):
        h = self.ln(x)
        b, s, d = h.shape
        q, k, v = (p(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        return self.o(a) + x


# the families whose linear layers merge parallel projections and write bf16 themselves: cpu_opt's oneDNN,
# and its AMX kernel where this CPU has AMX-INT8 (elsewhere that kernel cannot run)
MERGING_FAMILIES = ["onednn"] + (["amx"] if amx_kernel() is not None else [])


@pytest.mark.parametrize("family", MERGING_FAMILIES)
def test_parallel_projections_run_as_one_gemm(monkeypatch, family):
    """q, k and v (same input, same scale, fp32 outputs) on cpu_opt's oneDNN (or its AMX kernel) become
    one GEMM over their concatenated weights: one kernel call for the three, and the same numbers as
    three separate calls (per-channel scales concatenate; the input is quantized once either way)."""
    from cpu_opt.quant import api, graph as qgraph

    torch.manual_seed(0)
    m = _QKV().eval()
    calib = [(torch.randn(2, 16, 64, generator=gen(700 + i)),) for i in range(N_CALIB)]
    x = torch.randn(2, 16, 64, generator=gen(7))
    monkeypatch.setattr(api, "choose_family", lambda kind, rows, macs, conv=None, **_: (family, "forced"))
    merged = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    rows = {r["layer"]: r for r in merged.report()["int8"]}
    assert {r["family"] for r in rows.values()} == {family}
    groups = {r["merged_gemm"]["node"] for r in rows.values() if "merged_gemm" in r}
    assert len(groups) == 1 and sorted(rows["q"]["merged_gemm"]["layers"]) == ["k", "q", "v"]
    assert rows["q"]["merged_gemm"]["n"] == 192 and "merged_gemm" not in rows["o"]
    assert rows["o"]["residual_add"] is True
    with pytest.MonkeyPatch.context() as mp:
        calls = KernelCalls(mp)
        y = merged(x)
    assert calls.total() == 2 == calls.calls[(family, "linear")]   # q+k+v in one call, o in another
    monkeypatch.setattr(qgraph, "_merge_parallel_linears", lambda gm, report: 0)
    _same_without(m, x, calib, y, lambda rep: not any("merged_gemm" in r for r in rep["int8"]))


def _same_without(m, x, calib, y, without):
    """``m`` optimized again in int8 (a step of the pass switched off by the caller's monkeypatch;
    ``without(report)`` checks that it is off) gives ``y`` again, and ``y`` is close to fp32."""
    other = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    assert without(other.report())
    with torch.no_grad():
        y2, ref = other(x), m(x)
    assert torch.allclose(y, y2, rtol=1e-5, atol=1e-5), (y - y2).abs().max()
    cos, _ = compare(y, ref)
    assert cos >= MIN_COSINE, cos


def _force_bf16_attention(monkeypatch, real_route, family="onednn"):
    """The int8 graph's attention on torch's flash kernel in bf16, as on a CPU with native bf16 (every
    CPU runs the kernel; only its speed differs), and every int8 layer on ``family``."""
    from cpu_opt.platform import routing
    from cpu_opt.quant import api

    monkeypatch.setattr(api, "choose_family", lambda kind, rows, macs, conv=None, **_: (family, "forced"))
    monkeypatch.setattr(routing, "auto_dtype", lambda info=None: "bf16")
    monkeypatch.setattr(routing, "route", lambda work, dtype, *a, **k: routing.Route(work, dtype, "torch_flash", "forced")
                        if (work, dtype) in (("attention", "bf16"), ("attention", "int8"))
                        else real_route(work, dtype, *a, **k))


@pytest.mark.isa
@pytest.mark.parametrize("family", MERGING_FAMILIES)
def test_projections_feeding_a_bf16_attention_write_bf16(monkeypatch, family):
    """Where an int8 graph's attention runs torch's flash kernel in bf16, the merged query/key/value
    GEMM writes bfloat16 itself: the attention reads its slices without a cast, the output projection
    (read by no attention) keeps float32, and the result equals the same model with the projections
    writing float32 (the attention casts them to bf16 either way)."""
    from cpu_opt.backends import attention as battn
    from cpu_opt.compiler.passes import attention as pattn
    from cpu_opt.platform import routing

    torch.manual_seed(0)
    m = _QKV().eval()
    calib = [(torch.randn(2, 16, 64, generator=gen(710 + i)),) for i in range(N_CALIB)]
    x = torch.randn(2, 16, 64, generator=gen(17))
    real_route = routing.route
    _force_bf16_attention(monkeypatch, real_route, family)
    opt = cpu_opt.optimize(m, (x,), dtype="int8", calibration_data=calib, qconfig_mapping=minmax_mapping())
    assert any("1 int8 projection(s) feeding them write bf16" in line for line in opt.report()["passes"]), \
        opt.report()["passes"]
    kernels = [n.target for n in opt._base_plan.program.graph.nodes
               if n.op == "call_function" and isinstance(n.target, K.LINEAR_KERNELS[family])]
    assert sorted(str(k.float_out) for k in kernels) == ["torch.bfloat16", "torch.float32"]
    seen = []
    real_flash = battn.bf16_flash_attention

    def spy(q, k, v, *a, **kw):   # the dtypes the attention is handed
        seen.append((q.dtype, k.dtype, v.dtype))
        return real_flash(q, k, v, *a, **kw)

    for n in opt._base_plan.program.graph.nodes:
        if n.target is real_flash:
            n.target = spy
    opt._base_plan.program.recompile()
    with torch.no_grad():
        y = opt(x)
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen), seen
    assert y.dtype == torch.float32
    monkeypatch.setattr(pattn, "bf16_projections", lambda gm, attention: 0)
    _same_without(m, x, calib, y, lambda rep: not any("write bf16" in line for line in rep["passes"]))


def _projection_graph(kernel, also_added: bool):
    """x -> int8 projection -> view -> transpose -> bf16 attention (q = k = v), and with ``also_added``
    the projection's output read by an add too."""
    from cpu_opt.backends.attention import bf16_flash_attention

    aten = torch.ops.aten
    g = torch.fx.Graph()
    y = g.call_function(kernel, (g.placeholder("x"),))
    q = g.call_function(aten.transpose.int, (g.call_function(aten.view.default, (y, [1, 8, 4, 16])), 1, 2))
    a = g.call_function(bf16_flash_attention, (q, q, q))
    g.output((a, g.call_function(aten.add.Tensor, (y, 1.0))) if also_added else a)
    return torch.fx.GraphModule(torch.nn.Module(), g), a


@pytest.mark.isa
def test_bf16_projections_only_where_attention_alone_reads_the_output():
    """A projection also read by something other than an attention's q/k/v (an add) keeps float32;
    read by the attention alone it writes bf16, and the attention still returns float32."""
    from cpu_opt.compiler.passes.attention import bf16_projections

    def kernel():
        k = K.LINEAR_KERNELS["onednn"](torch.randint(-127, 128, (64, 64), dtype=torch.int8, generator=gen(3)),
                                       torch.full((64,), 0.01), None, (0.05, 128))
        k.__name__ = "int8_linear_test"   # as the int8 graph pass names its kernels (FX code generation)
        return k

    k = kernel()
    gm, a = _projection_graph(k, also_added=True)
    assert bf16_projections(gm, [a]) == 0 and k.float_out == torch.float32
    k = kernel()
    gm, a = _projection_graph(k, also_added=False)
    assert bf16_projections(gm, [a]) == 1 and k.float_out == torch.bfloat16
    xin = torch.randn(1, 8, 64, generator=gen(4))
    assert k(xin).dtype == torch.bfloat16 and gm(xin).dtype == torch.float32
    with pytest.raises(TypeError, match="bfloat16"):
        K.LINEAR_KERNELS["fbgemm"](torch.randint(-127, 128, (64, 64), dtype=torch.int8, generator=gen(5)),
                                   torch.full((64,), 0.01), None, (0.05, 128)).write_bf16()
