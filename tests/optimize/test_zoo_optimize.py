"""optimize() on the zoo (small configurations): numbers against eager, the report, bf16."""
import pytest
import torch
import torch.utils._pytree as pytree

import cpu_opt
from cpu_opt import routing
from cpu_opt.models import ZOO
from optimize_testutil import assert_whole_graph_in_torch, onednn_graph_used

MODELS = ["mlp", "resnet18", "bert_base", "gpt2_small", "mobilenetv3", "vit_b16"]

# Ops the optimize issue lists as lowered: none of them may appear among the fallbacks.
LISTED = {"aten.linear.default", "aten.addmm.default", "aten.mm.default", "aten.bmm.default", "aten.matmul.default",
          "aten.conv2d.default", "aten.batch_norm.default", "aten.layer_norm.default", "aten.softmax.int",
          "aten._softmax.default", "aten.relu.default", "aten.relu_.default", "aten.gelu.default", "aten.silu.default",
          "aten.sigmoid.default", "aten.tanh.default", "aten.hardswish.default", "aten.hardswish_.default",
          "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.max_pool2d.default",
          "aten.avg_pool2d.default", "aten.adaptive_avg_pool2d.default", "aten.cat.default", "aten.hardsigmoid.default"}


def _leaves(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            spec = ZOO[name]
            cache[name] = (spec, spec.build("small"), spec.example_inputs(2, "small"))
        return cache[name]

    return get


@pytest.mark.parametrize("name", MODELS)
def test_fp32_matches_eager_and_report(name, built):
    spec, model, inputs = built(name)
    opt = cpu_opt.optimize(model, inputs, dtype="fp32")
    with torch.no_grad():
        ref = spec.call(model, inputs)
    out = spec.call(opt, inputs)
    assert type(out) is type(ref)
    for a, b in zip(_leaves(out), _leaves(ref), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
    rep = opt.report()
    assert rep["dtype"] == "fp32"
    if not onednn_graph_used("fp32"):
        assert_whole_graph_in_torch(rep)
        return
    assert rep["num_partitions"] >= 1
    listed_fallbacks = [f for f in rep["fallbacks"] if f["op"] in LISTED]
    assert not listed_fallbacks, listed_fallbacks
    for p in rep["partitions"]:
        assert p["route"] == "onednn" and p["ops"]
    # a second call with the same shapes compiles nothing new
    from cpu_opt import dnnl

    before = dnnl.cache_stats().creations
    spec.call(opt, inputs)
    assert dnnl.cache_stats().creations == before


@pytest.mark.parametrize("name", MODELS)
def test_bf16_close_to_fp32(name, built):
    spec, model, inputs = built(name)
    opt = cpu_opt.optimize(model, inputs, dtype="bf16")
    with torch.no_grad():
        ref = spec.call(model, inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch_bf16 = spec.call(model, inputs)
    out = spec.call(opt, inputs)
    rep = opt.report()
    assert rep["dtype"] == "bf16"
    for a, b, c in zip(_leaves(out), _leaves(ref), _leaves(torch_bf16), strict=True):
        assert a.dtype == b.dtype  # outputs come back in the model's own dtype
        if not b.is_floating_point():
            continue
        if name == "mobilenetv3":
            # This small random MobileNetV3 loses precision in bf16 whoever runs it: torch's own
            # bf16 autocast reaches only ~0.988 here. Hold cpu_opt to torch's own bf16 result.
            assert _cos(a, b) >= min(0.999, _cos(c.float(), b) - 0.002)
        else:
            assert _cos(a, b) >= 0.999
    if onednn_graph_used("bf16"):
        assert rep["num_partitions"] >= 1
    else:
        assert_whole_graph_in_torch(rep)


def test_auto_dtype_follows_cpu(built):
    spec, model, inputs = built("mlp")
    opt = cpu_opt.optimize(model, inputs)
    assert opt.report()["dtype"] == routing.auto_dtype()
