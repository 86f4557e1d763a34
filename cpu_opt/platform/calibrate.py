"""``python -m cpu_opt calibrate``: time the candidate backends of every self-contained kind of routed
work on this machine and write the measured routing profile (:mod:`.profile`).

Each case builds the candidates that can run here — cpu_opt's oneDNN 3.2 binding (weights packed
once), torch's own oneDNN 3.12 through torch ops, torch's default kernel (MKL for fp32 GEMMs),
FBGEMM for int8 — checks each one's answer against a float64 (or exact integer) reference on the
same inputs, drops the ones that are refused or wrong (named in the profile with the reason), and
times the rest interleaved in one process, medians of several rounds. The fastest right one wins
unless the table's choice is within :data:`MARGIN` of it.

Shapes (full size; ``--quick`` shrinks them for tests):

* linear (constant weights): a GEMV x (1, 4096) @ W (4096, 4096) (weights bigger than the L3, as in
  LLM decoding), and BERT's FFN in, x (M, 768) @ W (768, 3072) at M = 128 and 2048; fp32 (MKL's
  packed sgemm and cpu_opt's own GEMV or packed GEMM among the candidates), bf16, and int8 (u8 activations, per-channel s8 weights);
* int8 convolution: 1 x 64 x 56 x 56, 64 filters 3x3, padding 1 (a ResNet stage);
* attention: batch 1, 12 heads, sequence 256, head size 64, fp32 and bf16;
* gnn_linear: a node-feature Linear layer's training step in ``cpu_opt.gnn`` (forward, input and
  weight gradients), 100,000 rows x 64 -> 64, on the tall-skinny GEMM against torch's ``F.linear``
  and autograd.

What is *not* measured here, on purpose: fp32/bf16 convolutions and matmuls of two activations.
They run inside oneDNN Graph partitions with the ops around them fused in; timing them bare and
moving one op out of its partition on the result costs that fusion, which no single-op timing sees.
Measured on the AMD EPYC Zen 3 (2026-12-01): routing ResNet-18's convolutions to torch (bare 3x3
conv + ReLU 5-10% faster in torch) took batch 1 from 26.7 ms to 48.6 ms; routing BERT-base's
explicit-attention matmuls to torch (bare batched matmul 8-16% faster) took it from 235 ms to
555 ms, the Divide+Add left behind running on oneDNN's reference binary kernel. Where those run is
decided per model, by ``optimize(..., autotune=True)`` (the whole oneDNN plan against torch).
"""
from __future__ import annotations

import contextlib
import threading
import datetime as _dt
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from . import hw, profile
from .timing import measure


@dataclass
class Spec:
    work: str
    dtype: str
    shape_class: str
    dims: tuple
    quick_dims: tuple


# The GEMV's weights (64 MB in fp32) are far larger than any L3, as in LLM decoding: with 768x3072
# (9 MB, cache-resident once warm) torch's oneDNN came out 10-15% ahead, while end to end on the MLP
# (1024-4096-4096-1024-1000, batch 1) cpu_opt's oneDNN was 7% faster (7.18 vs 7.68 ms) and at
# 4096x4096 the two tie (4.44 ms each), Zen 3, 2026-12-01.
FULL_LINEAR = {"gemv": (1, 4096, 4096), "m128": (128, 768, 3072), "m2048": (2048, 768, 3072)}
QUICK_LINEAR = {"gemv": (1, 64, 96), "m128": (16, 64, 96), "m2048": (64, 64, 96)}
SPECS = (
    *(Spec("linear", dt, cls, FULL_LINEAR[cls], QUICK_LINEAR[cls])
      for dt in ("fp32", "bf16", "int8") for cls in ("gemv", "m128", "m2048")),
    Spec("conv", "int8", profile.DEFAULT_CLASS, (1, 64, 56, 56, 64, 3), (1, 8, 10, 10, 8, 3)),
    Spec("attention", "fp32", profile.DEFAULT_CLASS, (1, 12, 256, 64), (1, 2, 16, 8)),
    Spec("attention", "bf16", profile.DEFAULT_CLASS, (1, 12, 256, 64), (1, 2, 16, 8)),
    Spec("gnn_linear", "fp32", profile.DEFAULT_CLASS, (100_000, 64, 64), (2048, 16, 16)),
)
TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Relative error (max |diff| / max |ref|) a candidate may show against the float64 reference.
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


@dataclass
class Built:
    """A case's candidates: ``fns`` to time, ``excluded`` backend -> reason."""
    shape: str
    fns: dict = field(default_factory=dict)
    excluded: dict = field(default_factory=dict)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def _admit(built: Built, name: str, make: Callable[[], Callable[[], torch.Tensor]], check: Callable[[torch.Tensor], str | None]):
    """Build candidate ``name``, run it once and check its answer; keep it or say why not."""
    try:
        fn = make()
        err = check(fn())
    except Exception as e:  # noqa: BLE001 - a backend that refuses the case is not a candidate
        msg = str(e).splitlines()[0] if str(e) else ""
        built.excluded[name] = f"refused: {type(e).__name__}: {msg[:160]}"
        return
    if err:
        built.excluded[name] = f"wrong answer: {err}"
    else:
        built.fns[name] = fn


def _float_check(ref: torch.Tensor, dtype: str):
    def check(y):
        r = _rel(y, ref)
        return None if r <= TOLERANCE[dtype] else f"relative error {r:.2e} > {TOLERANCE[dtype]:g}"
    return check


def _step_check(ref: torch.Tensor, out_scale: float):
    """For quantized (u8) outputs: an exact accumulation lands within half an output step, plus the
    requantization's rounding; a saturating kernel is many steps off."""
    def check(y):
        err = ((y.dequantize().double() - ref).abs().max() / out_scale).item()
        return None if err <= 1.0 else f"{err:.1f} output steps off"
    return check


# ----------------------------------------------------------------------------- the cases

def _linear(dtype: str, dims) -> Built:
    m, k, n = dims
    dt = TORCH_DTYPE[dtype]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dt)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dt)
    b = torch.randn(n, generator=g).to(dt)
    ref = x.double() @ w.double().t() + b.double()
    out = Built(f"{m}x{k}x{n}")
    check = _float_check(ref, dtype)
    # Inside a model a layer's weights arrive cold (the layers before evicted them), so each candidate
    # cycles through enough copies of them to miss the caches: with one copy hot in cache, cpu_opt's
    # oneDNN 3.2 won the bf16 m128 case by 20% on the Xeon with AMX (0.34 vs 0.43 ms) while in BERT-base
    # its 49 GEMMs took 23.1 ms against torch's oneDNN's 18.5 (packed weights, per-op timers)
    copies = [w] + [w.clone() for _ in range(_cold_copies(w) - 1)]

    def rotating(make_one):
        fns = [make_one(wc) for wc in copies]
        state = [0]

        def call():
            state[0] = (state[0] + 1) % len(fns)
            return fns[state[0]]()
        return call

    def ours(wc):
        from ..dnnl.primitives import Matmul

        mm = Matmul.from_linear(wc, b)
        return lambda: mm(x)

    def mkl_packed(wc):
        from ..backends import mkl

        if not mkl.available():
            raise RuntimeError("torch has no MKL here")
        packed = mkl.packed_weight(wc, m)
        return lambda: mkl.MKL_LINEAR(x, packed, wc, b, m)

    def torch_onednn(wc):   # as the runtime runs it: weights packed for the row count
        from ..backends.torch_onednn import TORCH_LINEAR, packed_linear_weight

        packed = packed_linear_weight(wc, m)
        return lambda: TORCH_LINEAR(x, packed, b, "none", [], "")

    _admit(out, "onednn", lambda: rotating(ours), check)
    _admit(out, "torch_onednn", lambda: rotating(torch_onednn), check)
    _admit(out, "torch", lambda: rotating(lambda wc: (lambda: F.linear(x, wc, b))), check)
    if dtype == "fp32":
        _admit(out, "mkl", lambda: rotating(mkl_packed), check)
    from .. import native
    from ..backends import native_linear

    if dtype == "fp32" and m <= native_linear.MAX_ROWS and native.vectorized():
        _admit(out, "native", lambda: rotating(lambda wc: (lambda: native_linear.linear(x, wc, b, False))), check)
    elif dtype == "fp32" and native.vectorized():
        def packed(wc):
            wp = native_linear.pack_weight(wc)
            return lambda: native_linear.packed_linear(x, wp, b, n)
        _admit(out, "native_gemm", lambda: rotating(packed), check)
    return out


# Weight copies a float linear case cycles through: together at least this many bytes, several times
# a core's L2 (2 MiB on the Xeon with AMX, 512 KiB on the Zen 3), so every call reads its weights from
# the last-level cache or memory, as a layer inside a model does.
COLD_BYTES = 32 << 20
MAX_COPIES = 16


def _cold_copies(w: torch.Tensor) -> int:
    return max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / max(1, w.numel() * w.element_size()))))


_ENGINE_LOCK = threading.Lock()


@contextlib.contextmanager
def quantized_engine(name: str):
    """torch's quantized engine set to ``name`` for a prepack (packed weights are engine-specific;
    cpu_opt.quant uses this too); one thread at a time, since the setting is process-wide."""
    with _ENGINE_LOCK:
        old = torch.backends.quantized.engine
        torch.backends.quantized.engine = name
        try:
            yield
        finally:
            torch.backends.quantized.engine = old


def _int8_inputs(shape, generator):
    """u8 activations over the range int8 kernels take exactly here: 8 bits with VNNI, 7 bits
    without (x86 kernels without VNNI add u8 x s8 pairs in int16 and saturate; torch's x86 qconfig
    uses reduce_range for that reason)."""
    hi = 256 if hw.has_vnni(hw.detect()) else 128
    return torch.randint(0, hi, shape, dtype=torch.uint8, generator=generator), hi


def _linear_int8(dims) -> Built:
    m, k, n = dims
    g = torch.Generator().manual_seed(0)
    x, hi = _int8_inputs((m, k), g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    xs, xz = 1.0 / hi, hi // 2
    ws = torch.rand(n, generator=g) * 0.01 + 0.001
    ref = ((x.double() - xz) * xs) @ (w.double() * ws.double()[:, None]).t()
    out = Built(f"{m}x{k}x{n} ({8 if hi == 256 else 7}-bit activations)")
    check = _float_check(ref, "fp32")

    def ours():
        from ..dnnl.primitives import Matmul

        mm = Matmul(w.t().contiguous(), src_scale=xs, weight_scales=ws, src_zero_point=xz)
        return lambda: mm(x)

    def theirs():
        packed = torch.ops.onednn.qlinear_prepack(w, [m, k])
        wz = torch.zeros(n, dtype=torch.int64)
        return lambda: torch.ops.onednn.qlinear_pointwise(x, xs, xz, packed, ws, wz, None, 1.0, 0, torch.float32,
                                                           "none", [], "")

    out_scale = float(ref.abs().max()) * 2 / 255 or 1.0

    def fbgemm():
        with quantized_engine("fbgemm"):
            qw = torch._make_per_channel_quantized_tensor(w, ws.double(), torch.zeros(n, dtype=torch.int64), 0)
            packed = torch.ops.quantized.linear_prepack(qw, None)
        qx = torch._make_per_tensor_quantized_tensor(x, xs, xz)
        return lambda: torch.ops.quantized.linear(qx, packed, out_scale, 128)

    def amx():
        from ..backends.amx_linear import AmxLinear

        lin = AmxLinear(w, ws, None, (xs, xz))
        return lambda: lin(x)

    from ..backends.amx_linear import kernel as amx_kernel

    _admit(out, "onednn", ours, check)
    _admit(out, "torch_onednn", theirs, check)
    _admit(out, "fbgemm", fbgemm, _step_check(ref, out_scale))
    if amx_kernel() is not None:   # a candidate only on CPUs with AMX-INT8 (under the ISA cap in force)
        _admit(out, "amx", amx, check)
    return out


def _conv_int8(dims) -> Built:
    n, c, h, w_, o, ks = dims
    g = torch.Generator().manual_seed(0)
    x, hi = _int8_inputs((n, c, h, w_), g)
    x = x.contiguous(memory_format=torch.channels_last)
    wt = torch.randint(-127, 128, (o, c, ks, ks), dtype=torch.int8, generator=g)
    xs, xz = 1.0 / hi, hi // 2
    ws = torch.rand(o, generator=g) * 0.01 + 0.001
    wz = torch.zeros(o, dtype=torch.int64)
    pad, one = [ks // 2] * 2, [1, 1]
    ref = F.conv2d((x.double() - xz) * xs, wt.double() * ws.double()[:, None, None, None], padding=ks // 2)
    out = Built(f"{n}x{c}x{h}x{w_} -> {o}, {ks}x{ks} ({8 if hi == 256 else 7}-bit activations)")
    out_scale = float(ref.abs().max()) * 2 / 255 or 1.0

    def theirs():
        packed = torch.ops.onednn.qconv_prepack(wt, ws, xs, xz, one, pad, one, 1, list(x.shape))
        return lambda: torch.ops.onednn.qconv2d_pointwise(x, xs, xz, packed, ws, wz, None, one, pad, one, 1,
                                                           1.0, 0, torch.float32, "none", [], "")

    def fbgemm():
        with quantized_engine("fbgemm"):
            qw = torch._make_per_channel_quantized_tensor(wt, ws.double(), wz, 0)
            packed = torch.ops.quantized.conv2d_prepack(qw, None, one, pad, one, 1)
        qx = torch._make_per_tensor_quantized_tensor(x, xs, xz)
        return lambda: torch.ops.quantized.conv2d(qx, packed, out_scale, 128)

    def ours():
        from ..backends.onednn_primitives import DnnlConv2d

        k = DnnlConv2d(wt, ws, None, (xs, xz), stride=1, padding=ks // 2, dilation=1, groups=1, x_shape=tuple(x.shape))
        return lambda: k(x)

    _admit(out, "onednn", ours, _float_check(ref, "fp32"))
    _admit(out, "torch_onednn", theirs, _float_check(ref, "fp32"))
    _admit(out, "fbgemm", fbgemm, _step_check(ref, out_scale))
    return out


def _attention(dtype: str, dims) -> Built:
    from ..backends import attention as battn

    bsz, heads, seq, d = dims
    dt = TORCH_DTYPE[dtype]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bsz, heads, seq, d, generator=g).to(dt) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    out = Built(f"{bsz}x{heads} heads x seq {seq} x {d}")
    check = _float_check(ref, dtype)
    _admit(out, "torch_flash", lambda: (lambda: F.scaled_dot_product_attention(q, k, v)), check)
    for (backend, dt), (fn, _) in battn.ROUTES.items():   # the routes for this dtype whose kernels run here
        if dt == dtype and battn.routed(backend, dtype) is not None:
            _admit(out, backend, lambda fn=fn: (lambda: fn(q, k, v)), check)
    return out


def _gnn_linear(dims) -> Built:
    """A node-feature Linear layer's training step as ``cpu_opt.gnn`` runs it: forward, then the input
    and weight gradients (what a full-batch GNN layer does once per epoch); the weight gradient is
    checked against float64."""
    from .. import native
    from ..gnn import pyg as gpyg

    m, k, n = dims
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).requires_grad_()
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).requires_grad_()
    b = torch.randn(n, generator=g).requires_grad_()
    go = torch.randn(m, n, generator=g)
    out = Built(f"{m} rows x {k} -> {n}, forward + backward")
    check = _float_check(go.double().t() @ x.detach().double(), "fp32")

    def step(f):
        def run():
            x.grad = w.grad = b.grad = None
            f(x, w, b).backward(go)
            return w.grad
        return run

    if native.vectorized() and gpyg.native_linear.ts_fits(k, n):
        _admit(out, "tall_skinny", lambda: step(gpyg._NativeLinear.apply), check)
    else:
        out.excluded["tall_skinny"] = "refused: no vectorized build of cpu_opt's native kernels here"
    _admit(out, "torch", lambda: step(F.linear), check)
    return out


def build(spec: Spec, quick: bool) -> Built:
    dims = spec.quick_dims if quick else spec.dims
    if spec.work == "linear":
        return _linear_int8(dims) if spec.dtype == "int8" else _linear(spec.dtype, dims)
    if spec.work == "conv" and spec.dtype == "int8":
        return _conv_int8(dims)
    if spec.work == "attention":
        return _attention(spec.dtype, dims)
    if spec.work == "gnn_linear":
        return _gnn_linear(dims)
    raise ValueError(f"no calibration case for work {spec.work!r}")


# ----------------------------------------------------------------------------- the run

def _repeats(fns: dict, budget_s: float, quick: bool) -> int:
    """Rounds that fit the case's time budget (3 to 60): one timed call of each gives the cost.
    Sub-millisecond calls get many rounds: their medians move most with the machine's noise."""
    if quick:
        return 3
    t0 = time.perf_counter()
    for f in fns.values():
        f()
    per_round = max(time.perf_counter() - t0, 1e-6)
    return int(min(60, max(3, budget_s / per_round)))


# The table's backend keeps the case unless another is faster by more than this: on the shared
# 2-vCPU machines here the same pair of kernels swapped places by up to 8% between calibrate runs,
# and a route flipped on noise moves work for nothing.
MARGIN = 0.10


def _winner(spec: Spec, times: dict) -> str:
    from . import routing

    fastest = min(times, key=times.get)
    table = routing.table_route(spec.work, spec.dtype, rows=profile.class_rows(spec.work, spec.shape_class)).backend
    if table in times and times[table] <= times[fastest] * (1 + MARGIN):
        return table
    return fastest


def calibrate(*, quick: bool = False, budget_s: float = 3.0, progress: bool = True, write: bool = True,
              specs=SPECS) -> profile.Profile:
    """Measure every case in ``specs`` and (``write``) save the profile for this machine."""
    from ..progress import Progress

    if hw.detect().arch != "x86_64":
        raise RuntimeError("calibrate measures x86-64 backends (cpu_opt's oneDNN binding, FBGEMM); on aarch64 "
                           "routing follows the table (see cpu_opt.graviton for the Arm tuning knobs)")
    t_start = time.perf_counter()
    bar = Progress(progress, len(specs), "cpu_opt calibrate")
    cases = []
    for spec in specs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation notes on quantized tensors
            built = build(spec, quick)
        times: dict = {}
        if built.fns:
            stats = measure(built.fns, warmup=1, repeats=_repeats(built.fns, budget_s, quick))
            times = {name: round(s.median * 1e3, 4) for name, s in stats.items()}
        if times:
            cases.append(profile.Case(spec.work, spec.dtype, spec.shape_class, built.shape, times, built.excluded,
                                      _winner(spec, times)))
        bar.step(f"{spec.work} {spec.dtype} {spec.shape_class}")
    bar.done()
    key = profile.current_key()
    prof = profile.Profile(key=key, cases=tuple(cases),
                           created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           seconds=round(time.perf_counter() - t_start, 2), path=str(profile.path_for(key)))
    if write:
        profile.save(prof)
    return prof


def table(prof: profile.Profile) -> list[dict]:
    """One row per case: the table's route beside the measured winner, and every candidate's time."""
    from . import routing

    rows = []
    for c in prof.cases:
        t = routing.table_route(c.work, c.dtype, rows=profile.class_rows(c.work, c.shape_class))
        rows.append({"work": c.work, "dtype": c.dtype, "class": c.shape_class, "shape": c.shape,
                     "table": t.backend, "measured": c.winner, "agree": t.backend == c.winner,
                     "times_ms": dict(c.times_ms), "excluded": dict(c.excluded)})
    return rows


def print_table(prof: profile.Profile, written: bool = True) -> None:
    rows = table(prof)
    print(f"routing profile for {hw.detect().label}, {prof.key['threads']} threads, torch {prof.key['torch']}, "
          f"oneDNN {prof.key['onednn']} — measured in {prof.seconds:.1f} s")
    print(f"  {'work':<9} {'dtype':<5} {'class':<7} {'table':<19} {'measured':<19} figures (median ms)")
    for r in rows:
        figs = ", ".join(f"{b} {t:.3g}" for b, t in sorted(r["times_ms"].items(), key=lambda kv: kv[1]))
        mark = "" if r["agree"] else "  <- the profile overrides the table"
        print(f"  {r['work']:<9} {r['dtype']:<5} {r['class']:<7} {r['table']:<19} {r['measured']:<19} {figs}{mark}")
        for b, why in r["excluded"].items():
            print(f"  {'':<43}not a candidate: {b}: {why}")
    if written:
        print(f"written to {prof.path}")
