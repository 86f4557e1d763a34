"""Fuzzing ``cpu_opt.optimize`` on randomly built small models: stacks of supported and unsupported
layers, views, in-place ops, and several output aliasing patterns (views of intermediate
results, the same tensor twice, the input itself, None). Each optimized model matches eager at
the example shape and at a new batch size, and no returned tensor changes when the model is
called again."""
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import cpu_opt

EXAMPLES = int(os.environ.get("CPU_OPT_CI_OPTIMIZE_EXAMPLES", "15"))
if os.environ.get("CPU_OPT_FUZZ_PROFILE") == "fuzz":
    EXAMPLES = int(os.environ.get("CPU_OPT_FUZZ_EXAMPLES", "2000")) // 10

WIDTH = 12
LAYERS = ["linear", "relu", "gelu", "tanh", "sigmoid", "layernorm", "residual", "scale", "cumsum", "softmax",
          "relu_", "add_", "transpose2", "reshape_back", "cat_self", "narrow_pad", "abs", "sub_const"]
OUTPUTS = ["plain", "narrow", "movedim", "expand", "unfold", "as_strided", "view_dtype", "tensor_split", "select",
           "twice", "with_input", "with_none", "dict", "t_contiguous"]


class Random(nn.Module):
    def __init__(self, layers, output):
        super().__init__()
        self.layers, self.output = list(layers), output
        self.lins = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for l in layers if l == "linear")
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for l in layers if l == "layernorm")

    def forward(self, x):
        h = x
        li = ni = 0
        for l in self.layers:
            if l == "linear":
                h = self.lins[li](h)
                li += 1
            elif l == "layernorm":
                h = self.norms[ni](h)
                ni += 1
            elif l == "relu":
                h = torch.relu(h)
            elif l == "gelu":
                h = nn.functional.gelu(h)
            elif l == "tanh":
                h = torch.tanh(h)
            elif l == "sigmoid":
                h = torch.sigmoid(h)
            elif l == "residual":
                h = h + x
            elif l == "scale":
                h = h * 0.5
            elif l == "cumsum":   # no oneDNN mapping: a fallback in the middle
                h = torch.cumsum(h, dim=-1)
            elif l == "softmax":
                h = torch.softmax(h, dim=-1)
            elif l == "relu_":
                h = h.clone().relu_()
            elif l == "add_":
                h = h.clone()
                h.add_(1.0)
            elif l == "transpose2":
                h = h.transpose(0, 1).contiguous().transpose(0, 1)
            elif l == "reshape_back":
                h = h.reshape(-1).reshape(h.shape)
            elif l == "cat_self":
                h = torch.cat([h, h], dim=-1)[..., :WIDTH]
            elif l == "narrow_pad":
                h = torch.nn.functional.pad(h.narrow(-1, 0, WIDTH - 2), (0, 2))
            elif l == "abs":
                h = h.abs()
            elif l == "sub_const":
                h = h - 0.25
        y = h + 1.0
        o = self.output
        if o == "plain":
            return y
        if o == "narrow":
            return y.narrow(1, 0, 5)
        if o == "movedim":
            return y.movedim(0, 1)
        if o == "expand":
            return y[:1].expand(3, -1)
        if o == "unfold":
            return y.unfold(1, 4, 2)
        if o == "as_strided":
            return y.as_strided((2, 3), (1, 2))
        if o == "view_dtype":
            return y.view(torch.int32)
        if o == "tensor_split":
            return y.tensor_split(3, dim=1)
        if o == "select":
            return y.select(1, 2)
        if o == "twice":
            return y, y
        if o == "with_input":
            return y, x
        if o == "with_none":
            return y, None
        if o == "dict":
            return {"a": y[:, :6], "b": torch.relu(y)}
        if o == "t_contiguous":
            return y.t().contiguous()
        raise ValueError(o)


def _leaves(out):
    import torch.utils._pytree as pytree

    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _assert_close(out, ref):
    import torch.utils._pytree as pytree

    assert pytree.tree_structure(out) == pytree.tree_structure(ref)
    for a, b in zip(_leaves(out), _leaves(ref), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == torch.int32:  # a float viewed as int32: compare the floats
            a, b = a.view(torch.float32), b.view(torch.float32)
        scale = b.abs().max().clamp_min(1e-6) if b.numel() else 1
        assert b.numel() == 0 or ((a - b).abs().max() / scale).item() < 1e-4


@settings(max_examples=EXAMPLES)
@given(layers=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=7), output=st.sampled_from(OUTPUTS),
       batch=st.integers(2, 6), seed=st.integers(0, 2 ** 16))
def test_random_models_match_eager_and_keep_their_outputs(layers, output, batch, seed):
    torch.manual_seed(seed)
    model = Random(layers, output).eval()
    x = torch.randn(batch, WIDTH)
    opt = cpu_opt.optimize(model, x, dtype="fp32")
    with torch.no_grad():
        ref = model(x)
    out = opt(x)
    _assert_close(out, ref)
    kept = [t.clone() for t in _leaves(out)]
    x2 = torch.randn(batch, WIDTH)
    out2 = opt(x2)  # a later call with the same shape must not write into the first call's outputs
    for t, k in zip(_leaves(out), kept):
        assert torch.equal(t, k), f"a returned tensor changed after a later call ({output}, {layers})"
    with torch.no_grad():
        _assert_close(out2, model(x2))
    x3 = torch.randn(batch + 3, WIDTH)  # a new batch size
    with torch.no_grad():
        _assert_close(opt(x3), model(x3))
    rep = opt.report()
    assert rep["validation"] is None or rep["validation"]["ok"] or "fell_back" in rep["validation"]
