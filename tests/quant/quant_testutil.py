"""Helpers for the int8 tests in tests/quant (imported by name: each test file puts this folder on
sys.path; pytest runs with --import-mode=importlib, so nothing else does)."""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from cpu_opt.quant import kernels as K
from cpu_opt.quant.qconfig import default_reduce_range

# Without VNNI the u8 x s8 kernels add pairs of products in int16 (vpmaddubsw), which saturates
# with full-range 8-bit activations: inputs then use 7 bits (what the default qconfig does there).
REDUCE_RANGE = default_reduce_range()
X_QMAX = 127 if REDUCE_RANGE else 255

REF_POST = {
    None: lambda t: t,
    "relu": torch.relu,
    "gelu_erf": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
    "hardswish": F.hardswish,
}


def buildable_families(kind: str) -> list[str]:
    """The kernel families of ``kind`` ("linear" / "conv2d") that build and run on this machine
    (cpu_opt's own oneDNN binding needs its library; "torch" is the routing table's alias of fbgemm)."""
    table = K.LINEAR_KERNELS if kind == "linear" else K.CONV_KERNELS
    out = []
    with warnings.catch_warnings():     # torch: quantized dtypes are deprecated
        warnings.simplefilter("ignore")
        for fam, ok in ((f, _builds(kind, c)) for f, c in table.items() if f != "torch"):
            if ok:
                out.append(fam)
    assert table["torch"] is table["fbgemm"]
    return out


def _builds(kind, cls) -> bool:
    try:
        if kind == "linear":
            wq = torch.ones(4, 8, dtype=torch.int8)
            cls(wq, torch.full((4,), 0.01), None, (0.1, 3))(torch.zeros(2, 8))
        else:
            wq = torch.ones(4, 2, 3, 3, dtype=torch.int8)
            k = cls(wq, torch.full((4,), 0.01), None, (0.1, 3), stride=1, padding=1, dilation=1, groups=1)
            k.own_out_qparams = (0.1, 128)
            k(torch.zeros(1, 2, 5, 5))
    except Exception:  # noqa: BLE001 - not available on this machine
        return False
    return True


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grid_input(shape, scale: float, zp: int, seed: int, qmax: int = X_QMAX, channels_last: bool = False):
    """A float32 input that lies exactly on the (scale, zp) grid (scale a power of two), so every
    family quantizes it to the same bytes whatever its rounding; and those bytes as uint8."""
    q = torch.randint(0, qmax + 1, shape, generator=gen(seed))
    x = (q - zp).float() * scale
    u = q.to(torch.uint8)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        u = u.contiguous(memory_format=torch.channels_last)
    return x, u


def int8_weights(shape, seed: int):
    """int8 weights in -127..127 and positive per-output-channel scales."""
    g = gen(seed)
    wq = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    ws = torch.rand(shape[0], generator=g) * 0.01 + 0.002
    return wq, ws


def dequant_w(wq, ws):
    return wq.double() * ws.double().reshape((-1,) + (1,) * (wq.dim() - 1))


def minmax_qparams(t: torch.Tensor, qmax: int = 255) -> tuple[float, int]:
    """Per-tensor affine uint8 parameters covering ``t`` (and 0), like a MinMax observer."""
    lo, hi = min(float(t.min()), 0.0), max(float(t.max()), 0.0)
    scale = max((hi - lo) / qmax, 1e-8)
    zp = int(min(max(round(-lo / scale), 0), qmax))
    return scale, zp


def quantize_ref(t: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    return torch.clamp(torch.round(t.double() / scale) + zp, 0, 255)


def dequant_u8(u: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    return (u.double() - zp) * scale


def float_leaves(out):
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def cosine(a, b) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def sqnr_db(x, ref) -> float:
    noise = (x.double() - ref.double()).pow(2).sum().item()
    sig = ref.double().pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * math.log10(sig / noise)


def compare(out, ref) -> tuple[float, float]:
    """(min cosine, min SQNR dB) over the floating-point leaves of two model outputs."""
    a, b = float_leaves(out), float_leaves(ref)
    assert len(a) == len(b) and a, (len(a), len(b))
    return min(cosine(x, y) for x, y in zip(a, b)), min(sqnr_db(x, y) for x, y in zip(a, b))


def call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


class KernelCalls:
    """Counts the int8 kernel runs (``_Kernel.run``) per (family, kind) while installed."""

    def __init__(self, monkeypatch):
        self.calls: dict[tuple[str, str], int] = {}
        counts = self.calls
        # _Kernel itself has no run: every family class defines its own, so each is wrapped
        for cls in {*K.LINEAR_KERNELS.values(), *K.CONV_KERNELS.values()}:
            run = cls.run

            def wrapped(self, x, other=None, _run=run):
                key = (self.family, self.kind)
                counts[key] = counts.get(key, 0) + 1
                return _run(self, x, other)

            monkeypatch.setattr(cls, "run", wrapped)
        # a chain of cpu_opt oneDNN primitives runs its members' kernels without their run(): when
        # none of them was counted during a chain call, the bound chain ran them all
        from cpu_opt.backends.onednn_primitives import PrimitiveChain

        chain_call = PrimitiveChain.__call__

        def chained(self, *inputs, _call=chain_call):
            before = sum(counts.values())
            out = _call(self, *inputs)
            if sum(counts.values()) == before:
                for kernel, _src, _other in self.members:
                    if hasattr(kernel, "family"):
                        key = (kernel.family, kernel.kind)
                        counts[key] = counts.get(key, 0) + 1
            return out

        monkeypatch.setattr(PrimitiveChain, "__call__", chained)

    def total(self) -> int:
        return sum(self.calls.values())

    def families(self) -> set[str]:
        return {f for f, _ in self.calls}

    def reset(self):
        self.calls.clear()


def program_kernels(prog) -> list:
    """``(kernel, returned)`` for every int8 kernel and uint8 pooling step of a runtime program, the
    members of a :class:`PrimitiveChain` included; ``returned``: the caller gets its output itself."""
    from cpu_opt.backends.onednn_primitives import PrimitiveChain

    out_nodes = set(next(n for n in prog.graph.nodes if n.op == "output").all_input_nodes)
    found = []
    for n in prog.graph.nodes:
        if isinstance(n.target, PrimitiveChain):
            items = {u.args[1]: u for u in n.users}
            for j, (kernel, _src, _other) in enumerate(n.target.members):
                k = n.target.exports.index(j) if j in n.target.exports else None
                found.append((kernel, k is not None and items.get(k) in out_nodes))
        elif hasattr(n.target, "reuse_output"):
            found.append((n.target, n in out_nodes))
    return found


def ref_conv2d(x, w, b, stride, padding, dilation, groups):
    """2-D convolution in float64 by unfold + matmul (torch's float64 grouped convolution is a slow
    reference path: 0.3 s for a tiny depthwise case)."""
    x, w = x.double().contiguous(), w.double()
    n, cin, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)   # n, cin*kh*kw, L
    oh = (h + 2 * padding - dilation * (kh - 1) - 1) // stride + 1
    ow = (wd + 2 * padding - dilation * (kw - 1) - 1) // stride + 1
    cols = cols.reshape(n, groups, cg * kh * kw, oh * ow)
    wg = w.reshape(groups, cout // groups, cg * kh * kw)
    y = torch.einsum("gok,ngkl->ngol", wg, cols).reshape(n, cout, oh, ow)
    if b is not None:
        y = y + b.double().reshape(1, -1, 1, 1)
    return y


# ------------------------------------------------------------------------------------- models
def minmax_qconfig():
    """Static int8 with MinMax-calibrated activations (cheap to convert; the default's histogram
    range search costs ~0.2 s per layer) and the default per-channel symmetric int8 weights."""
    from cpu_opt.quant import MinMaxObserver, QConfig
    from cpu_opt.quant.qconfig import default_weight_observer

    act = MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=REDUCE_RANGE)
    return QConfig(activation=act, weight=default_weight_observer())


def minmax_mapping():
    from cpu_opt.quant import QConfigMapping

    qc = minmax_qconfig()
    return QConfigMapping().set_object_type(torch.nn.Linear, qc).set_object_type(torch.nn.Conv2d, qc)


class SmallCNN(torch.nn.Module):
    """conv-bn-relu, a strided conv, a depthwise + pointwise pair, a grouped conv, global pool, fc."""

    def __init__(self, classes: int = 10):
        nn = torch.nn
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pw = nn.Conv2d(32, 32, 1)
        self.grouped = nn.Conv2d(32, 32, 3, padding=1, groups=4)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.pw(torch.relu(self.dw(x))))
        x = torch.relu(self.grouped(x)) + x
        return self.fc(x.mean((2, 3)))


def small_cnn(seed: int = 0) -> SmallCNN:
    torch.manual_seed(seed)
    m = SmallCNN()
    with torch.no_grad():   # non-trivial BatchNorm statistics
        m.bn1.running_mean.uniform_(-0.2, 0.2)
        m.bn1.running_var.uniform_(0.5, 2.0)
        m.bn1.weight.uniform_(0.5, 1.5)
        m.bn1.bias.uniform_(-0.2, 0.2)
    return m.eval()


def batches(shape, n: int, seed: int):
    g = gen(seed)
    return [(torch.randn(shape, generator=g),) for _ in range(n)]


def histogram_mapping(bins: int = 256):
    """The default qconfig (histogram-calibrated activations, L2-optimal range) with 256 bins
    instead of 2048: the range search is quadratic in the bins, and 256 is plenty for these tests."""
    from cpu_opt.quant import HistogramObserver, QConfig, QConfigMapping
    from cpu_opt.quant.qconfig import default_weight_observer

    act = HistogramObserver.with_args(bins=bins, dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                      reduce_range=REDUCE_RANGE)
    qc = QConfig(activation=act, weight=default_weight_observer())
    return QConfigMapping().set_object_type(torch.nn.Linear, qc).set_object_type(torch.nn.Conv2d, qc)
