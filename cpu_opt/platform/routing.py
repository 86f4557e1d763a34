"""The routing table: which backend runs each kind of work, given the CPU's features and dtype.

The table is data (:data:`RULES`): for each (work, dtype) the rules are tried in order and the
first whose conditions hold wins. Every rule cites the measurement that justifies it. Routing
reads :func:`cpu_opt.hw.detect`, so ``CPU_OPT_MAX_ISA`` changes the routes.

Backends:
``onednn``        cpu_opt's own oneDNN binding (primitives / Graph API, weights packed once)
``torch``         PyTorch's own kernel for the op (MKL/oneDNN-inside-torch/ATen)
``torch_onednn``  torch's own, newer oneDNN (3.12, linked into torch) through ``torch.ops.mkldnn._linear_pointwise``
``torch_flash``   torch's fused CPU flash-attention kernel (``scaled_dot_product_attention``)
``bf16_matmul_softmax``  attention as bf16 matmul -> softmax -> bf16 matmul
``fbgemm``        torch's x86 int8 engine (FBGEMM)
``acl``           Arm Compute Library through torch's oneDNN (aarch64; bf16 fast-math on BF16 cores)
``native_<variant>``  cpu_opt's C kernels (avx512 / avx2 / base)
"""
from __future__ import annotations

from dataclasses import dataclass

from . import hw

WORK_KINDS = ("gemm", "linear", "conv", "attention", "gnn")
# "gemm": any matmul the oneDNN graph takes; "linear": a GEMM against constant weights (nn.Linear, or
# addmm/mm with a parameter), which can also run on torch's own oneDNN with the weights as they are.
DTYPES = ("fp32", "bf16", "int8")


@dataclass(frozen=True)
class Rule:
    work: str
    dtype: str
    backend: str
    why: str                               # the measurement or fact behind the rule
    arch: str = "x86_64"
    any_of: tuple = ()                     # at least one of these feature sets must be present
    none_of: frozenset = frozenset()       # none of these features may be present

    def applies(self, info: hw.CPUInfo) -> bool:
        if self.arch != "any" and info.arch != self.arch:
            return False
        if self.any_of and not any(set(req) <= info.isa for req in self.any_of):
            return False
        return not (self.none_of & info.isa)


AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
BF16_HW = (frozenset({"avx512_bf16"}), frozenset({"amx_bf16"}))
VNNI = (frozenset({"avx512_vnni"}), frozenset({"amx_int8"}), frozenset({"avx_vnni"}))

ZEN5 = "measured on AMD Zen 5 (2 threads, shared/KNOWN.md)"
HERE = "measured on this project's AMD Zen 3 (AVX2) machine, oneDNN 3.2 (bench/results/dnnl.json)"

RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- GEMM
    Rule("gemm", "fp32", "onednn",
         f"oneDNN 3.2 fp32 matmul with packed weights vs torch.matmul (MKL): 230 vs 108 GFLOP/s per core at 1024^3, "
         f"2-5x on transformer shapes; {ZEN5}", any_of=(AVX512,)),
    Rule("gemm", "fp32", "onednn",
         f"on AVX2 oneDNN uses gemm:jit:f32; python -m bench dnnl compares it with torch.matmul side by side; {HERE}",
         any_of=(frozenset({"avx2", "fma"}),)),
    Rule("gemm", "fp32", "torch", "no AVX2: oneDNN has no tuned fp32 kernel; torch's reference paths are as good"),
    Rule("gemm", "bf16", "onednn",
         f"oneDNN 3.2 bf16 matmul: about 486 GFLOP/s per core, 1.2-1.3x torch's bf16 path; {ZEN5}", any_of=BF16_HW),
    Rule("gemm", "bf16", "torch",
         f"oneDNN 3.2 has no bf16 matmul without avx512_core (dnnl_unimplemented); {HERE}"),
    Rule("gemm", "int8", "onednn",
         "u8 x s8 with VNNI: oneDNN avx512_core_vnni kernels, exact s32 accumulation (shared/KNOWN.md)", any_of=VNNI),
    Rule("gemm", "int8", "fbgemm",
         f"without VNNI oneDNN's u8 x s8 pairs saturate in int16 (wrong for 8-bit activations; exact only for 7-bit); "
         f"FBGEMM with reduce_range is torch's x86 default; {HERE}", any_of=(frozenset({"avx2"}),)),
    Rule("gemm", "int8", "torch", "no AVX2: torch's reference quantized kernels"),
    # ---------------------------------------------------------------- linear layers (constant weights)
    Rule("linear", "fp32", "onednn", f"oneDNN 3.2's brgemm kernels need avx512_core; {ZEN5}", any_of=(AVX512,)),
    Rule("linear", "fp32", "torch_onednn",
         "pip oneDNN 3.2 has only gemm:jit:f32 on AVX2 while torch's oneDNN 3.12 has brg_matmul:avx2: "
         "128x768x3072 took 10.4 ms vs 5.6 ms (2 threads, interleaved medians), other BERT shapes tie; end to end "
         "BERT-base 1.21x and ViT-B/16 1.19x at batch 1 with every linear on torch's oneDNN (A/B in one process); "
         "measured on this project's AMD Zen 3 (AVX2) machine", any_of=(frozenset({"avx2", "fma"}),)),
    Rule("linear", "fp32", "torch", "no AVX2: torch's own kernels"),
    Rule("linear", "bf16", "onednn", f"oneDNN 3.2 bf16 matmul with packed weights; {ZEN5}", any_of=BF16_HW),
    Rule("linear", "bf16", "torch", f"no native bf16: emulated either way; {HERE}"),
    Rule("linear", "int8", "onednn", "u8 x s8 with VNNI: oneDNN kernels (see gemm)", any_of=VNNI),
    Rule("linear", "int8", "fbgemm", "without VNNI: FBGEMM with reduce_range (see gemm)", any_of=(frozenset({"avx2"}),)),
    Rule("linear", "int8", "torch", "no AVX2: torch's reference quantized kernels"),
    # ---------------------------------------------------------------- convolution
    Rule("conv", "fp32", "onednn",
         "oneDNN NHWC convolution with packed weights and fused bias/sum/ReLU post-ops (one Graph partition, "
         "3.5e-7 from a float64 reference; shared/KNOWN.md)", any_of=(frozenset({"avx2", "fma"}),)),
    Rule("conv", "fp32", "torch", "no AVX2: oneDNN has no tuned fp32 convolution below AVX2"),
    Rule("conv", "bf16", "onednn", f"oneDNN bf16 convolution needs avx512_bf16/AMX; {ZEN5}", any_of=BF16_HW),
    Rule("conv", "bf16", "torch", f"oneDNN 3.2 has no bf16 convolution on this ISA; {HERE}"),
    Rule("conv", "int8", "onednn", "oneDNN int8 convolution with VNNI", any_of=VNNI),
    Rule("conv", "int8", "fbgemm", "no VNNI: FBGEMM (reduce_range) is torch's x86 default for int8 conv",
         any_of=(frozenset({"avx2"}),)),
    Rule("conv", "int8", "torch", "no AVX2: torch's reference quantized kernels"),
    # ---------------------------------------------------------------- attention
    Rule("attention", "bf16", "torch_flash", "with AMX, torch's flash-attention kernel uses AMX tiles",
         any_of=(frozenset({"amx_bf16"}),)),
    Rule("attention", "bf16", "bf16_matmul_softmax",
         f"without AMX torch's CPU flash kernel gains nothing from bf16, while bf16 matmul->softmax->matmul is about "
         f"2.7x faster (batch 1, 12 heads, seq 512, dim 64); {ZEN5}", any_of=(frozenset({"avx512_bf16"}),)),
    Rule("attention", "bf16", "torch_flash", "no native bf16 dot products: bf16 matmuls would be emulated"),
    Rule("attention", "fp32", "torch_flash",
         "torch's flash kernel is the default CPU SDPA and avoids materialising the score matrix"),
    # ---------------------------------------------------------------- GNN kernels
    Rule("gnn", "fp32", "native_avx512", "cpu_opt's C kernels, AVX-512 variant", any_of=(AVX512,)),
    Rule("gnn", "fp32", "native_avx2", "cpu_opt's C kernels, AVX2 variant", any_of=(frozenset({"avx2", "fma", "f16c"}),)),
    Rule("gnn", "fp32", "native_base", "cpu_opt's C kernels, baseline build"),
    Rule("gnn", "bf16", "native_avx512", "bf16 features are widened to fp32 in registers", any_of=(AVX512,)),
    Rule("gnn", "bf16", "native_avx2", "bf16 features are widened to fp32 in registers",
         any_of=(frozenset({"avx2", "fma", "f16c"}),)),
    Rule("gnn", "bf16", "native_base", "baseline build"),
    # ---------------------------------------------------------------- aarch64 (no cpu_opt oneDNN binding there)
    *(Rule(w, "fp32", "acl", "Graviton: fp32 GEMM/conv on ACL through torch's oneDNN; bf16 fast-math when asked "
                             "(AWS: up to 3.5x ResNet-50, 1.4x BERT on Graviton3; not measured here)", arch="aarch64")
      for w in ("gemm", "linear", "conv")),
    *(Rule(w, "bf16", "acl", "ACL bf16 kernels on cores with BF16 (Neoverse V1/V2)", arch="aarch64",
           any_of=(frozenset({"bf16"}),)) for w in ("gemm", "linear", "conv")),
    *(Rule(w, "bf16", "torch", "no BF16 instructions (Neoverse N1): torch's own path", arch="aarch64")
      for w in ("gemm", "linear", "conv")),
    *(Rule(w, "int8", "torch", "torch's quantized engine (qnnpack/onednn) on aarch64", arch="aarch64")
      for w in ("gemm", "linear", "conv")),
    Rule("attention", "fp32", "torch_flash", "torch's SDPA", arch="aarch64"),
    Rule("attention", "bf16", "torch_flash", "torch's SDPA", arch="aarch64"),
    Rule("gnn", "fp32", "native_base", "cpu_opt's C kernels (Neon via the compiler)", arch="aarch64"),
    Rule("gnn", "bf16", "native_base", "cpu_opt's C kernels (Neon via the compiler)", arch="aarch64"),
)


# Below this many activation rows a linear layer is a GEMV: there cpu_opt's oneDNN 3.2 ties with or
# beats torch's oneDNN on AVX2 (M=1, 768x3072: 0.48 vs 0.77 ms; 1024x4096 and 4096x4096 level), while
# from M=4 torch's brgemm wins (1024x4096 1.33x, 4096x4096 1.58x); python -m bench dnnl shapes, 2 threads.
LINEAR_TORCH_MIN_ROWS = 4


@dataclass(frozen=True)
class Route:
    work: str
    dtype: str
    backend: str
    why: str


def route(work: str, dtype: str, info: hw.CPUInfo | None = None) -> Route:
    """The backend for ``work`` at ``dtype`` on this CPU (or on ``info``)."""
    if work not in WORK_KINDS:
        raise ValueError(f"unknown work kind {work!r}; expected one of {WORK_KINDS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    info = info or hw.detect()
    for r in RULES:
        if r.work == work and r.dtype == dtype and r.applies(info):
            return Route(work, dtype, r.backend, r.why)
    return Route(work, dtype, "torch", "no rule matched: PyTorch's own kernels")


def routes(info: hw.CPUInfo | None = None) -> dict[str, dict[str, dict]]:
    """Every route as ``{work: {dtype: {"backend": ..., "why": ...}}}``."""
    info = info or hw.detect()
    out: dict[str, dict[str, dict]] = {}
    for w in WORK_KINDS:
        for d in DTYPES:
            if w in ("attention", "gnn") and d == "int8":
                continue
            r = route(w, d, info)
            out.setdefault(w, {})[d] = {"backend": r.backend, "why": r.why}
    return out


def auto_dtype(info: hw.CPUInfo | None = None) -> str:
    """What ``dtype="auto"`` means here: bf16 where the CPU has native bf16 math, else fp32."""
    info = info or hw.detect()
    if info.arch == "x86_64":
        return "bf16" if info.has("avx512_bf16") or info.has("amx_bf16") else "fp32"
    return "bf16" if info.has("bf16") else "fp32"
