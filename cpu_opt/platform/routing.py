"""The routing table: which backend runs each kind of work, given the CPU's features and dtype.

The table is data (:data:`RULES`): for each (work, dtype) the rules are tried in order and the
first whose conditions hold wins. Every rule cites the measurement that justifies it. Routing
reads :func:`cpu_opt.hw.detect`, so ``CPU_OPT_MAX_ISA`` changes the routes.

Backends:
``onednn``        cpu_opt's own oneDNN binding (primitives / Graph API, weights packed once)
``torch``         PyTorch's own kernel for the op (MKL/oneDNN-inside-torch/ATen)
``torch_onednn``  torch's own, newer oneDNN (3.12, linked into torch) through ``torch.ops.mkldnn._linear_pointwise``
``mkl``           MKL's packed sgemm inside torch (``torch.ops.mkl._mkl_linear``), fp32 linear layers
``native``        cpu_opt's own kernels (``native/``): the decode-step GEMV
``native_winograd``  cpu_opt's fp32 3x3 convolution by Winograd's F(2x2 or 4x4, 3x3) (``native/kernels/winograd.c``),
                  stride-1 3x3 layers on AVX2 CPUs; ``conv`` (work ``conv3x3`` only): the ``conv`` route
``native_gemm``   cpu_opt's packed fp32 GEMM (``native/kernels/sgemm.c``: weights packed once into 16-column
                  panels, a 6x16 AVX2 register tile), linear layers of 4+ rows on AVX2 CPUs
``torch_flash``   torch's fused CPU flash-attention kernel (``scaled_dot_product_attention``)
``bf16_matmul_softmax``  attention as bf16 matmul -> softmax -> bf16 matmul
``amx``           cpu_opt's int8 GEMM on AMX tiles (``native/kernels/amx_qlinear.c``), int8 linear layers
``amx_bf16``      cpu_opt's fused bf16 attention on AMX tiles (``native/kernels/amx_attention.c``; int8 graphs)
``dpbf16``        the same attention on AVX512_BF16 dot products (``native/kernels/dpbf16_attention.c``; int8 graphs)
``f32_fused``     the same attention in float32 on AVX-512 FMA (``native/kernels/f32_attention.c``; float32 graphs, and
                  the attention of int8 graphs on CPUs without native bf16)
``fbgemm``        torch's x86 int8 engine (FBGEMM)
``acl``           Arm Compute Library through torch's oneDNN (aarch64; bf16 fast-math on BF16 cores)
``native_<variant>``  cpu_opt's C kernels (avx512 / avx2 / base)
``tall_skinny``   cpu_opt's tall-skinny GEMM (``native/kernels/tsgemm.c``): ``cpu_opt.gnn``'s node-feature Linear
                  layers (10^4+ rows by a few dozen features), forward, input and weight gradients
"""
from __future__ import annotations

from dataclasses import dataclass

from . import hw
from .. import native

WORK_KINDS = ("gemm", "linear", "conv", "conv3x3", "attention", "gnn", "gnn_linear")
# "gemm": any matmul the oneDNN graph takes; "linear": a GEMM against constant weights (nn.Linear, or
# addmm/mm with a parameter), which can also run on torch's own oneDNN with the weights as they are;
# "conv3x3": a 3x3 stride-1 convolution without groups or dilation, on constant weights (Winograd's
# F(2x2, 3x3) applies), whose backend "conv" means: as any convolution;
# "gnn_linear": cpu_opt.gnn's Linear layers on node features in training (fp32 only).
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
    max_rows: int | None = None            # linear: applies only to layers with at most this many rows
    max_macs: int | None = None            # linear: applies only to layers doing fewer multiply-adds
    min_macs: int | None = None            # linear: applies only to layers doing at least this many
    min_rows: int | None = None            # linear: applies only to layers with at least this many rows
    # a library that picks its kernels by the CPUID vendor string (MKL) behaves by vendor, not by
    # features alone: such a rule names the vendor its measurement holds for
    vendor: str | None = None

    def applies(self, info: hw.CPUInfo, rows: int | None = None, macs: int | None = None) -> bool:
        if self.max_rows is not None and (rows is None or rows > self.max_rows):
            return False
        if self.max_macs is not None and (macs is None or macs >= self.max_macs):
            return False
        if self.min_macs is not None and macs is not None and macs < self.min_macs:
            return False
        if self.min_rows is not None and rows is not None and rows < self.min_rows:
            return False
        if self.arch != "any" and info.arch != self.arch:
            return False
        if self.vendor is not None and info.vendor != self.vendor:
            return False
        if self.any_of and not any(set(req) <= info.isa for req in self.any_of):
            return False
        return not (self.none_of & info.isa)


AVX512 = hw.AVX512_CORE
AVX2 = hw.AVX2_FMA
BF16_HW = (frozenset({"avx512_bf16"}), frozenset({"amx_bf16"}))
VNNI = (frozenset({"avx512_vnni"}), frozenset({"amx_int8"}), frozenset({"avx_vnni"}))

# Below this many activation rows a linear layer is a GEMV and its own table rule applies (see it).
LINEAR_TORCH_MIN_ROWS = 4
# Below this many multiply-adds (rows x K x N) a linear layer stays on torch's addmm (see the rule).
SMALL_GEMM_MACS = 16_000_000
# Below this many multiply-adds a GEMV runs on cpu_opt's own kernel (see the rule).
GEMV_NATIVE_MAX_MACS = 32_000_000
# Below this many multiply-adds (output pixels x Cin x Cout x 9) a 3x3 convolution stays on the `conv` route:
# the smallest measured for Winograd is 115M (ResNet-50's 512-channel 7x7 layers).
WINOGRAD_MIN_MACS = 16_000_000
# Below this many 2x2 output tiles (batch x ceil(OH / 2) x ceil(OW / 2): the rows of its 16 GEMMs) a 3x3
# convolution stays on the `conv` route: the transformed weights are streamed for too little work (see the rule);
# with this many 4x4 tiles it takes F(4x4, 3x3).
WINOGRAD_MIN_TILES = 36

# Where each rule's figures come from. Rules name the CPU they were measured on; a rule for a CPU
# no session had says so. Re-measure with `python -m cpu_opt calibrate` (whose profile then
# overrides the rule on that machine) and update the citation.
ZEN5 = "AMD Zen 5 (AVX-512, AVX512_BF16, VNNI), 2 threads, shared/KNOWN.md"
ICX = "Intel Ice Lake-SP (AVX-512, VNNI, no AVX512_BF16), 2 threads, shared/KNOWN.md"
ZEN4 = "AMD EPYC Zen 4 (family 25 model 17: AVX-512, AVX512_BF16, VNNI, no AMX), 2 threads, 2026-12-03"
ZEN3 = "AMD EPYC Zen 3 (family 25 model 1, AVX2 only), 2 threads, 3 calibrate runs, 2026-12-01"
ZEN3_DEC6 = "the same Zen 3, 2 threads, 2026-12-06"
ZEN3_DEC7 = "the same Zen 3, 2 threads, 2026-12-07"
ZEN3_EARLIER = "the same Zen 3, November 2026, end-to-end A/B"
XEON_AMX = ("Intel Xeon with AMX (family 6 model 167: AVX512_BF16, AVX512_FP16, AMX-BF16/INT8), 2 threads, "
            "2026-12-02")
XEON_AMX_DEC7 = "the same Xeon type with AMX (family 6 model 167), 2 threads, 2026-12-07"
XEON_EMR = "Intel Xeon Emerald Rapids (family 6 model 207: AVX-512, VNNI, AVX512_BF16, AMX), 2 threads, 2026-12-06"
UNMEASURED = "not measured on any machine this project ran on"

RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- GEMM (two activations: attention's matmuls)
    Rule("gemm", "fp32", "onednn",
         f"oneDNN 3.2 fp32 matmul vs torch.matmul (MKL): 230 vs 108 GFLOP/s per core at 1024^3, {ZEN5}; level on the "
         f"Ice Lake (197 vs 207 GFLOP/s at 1024^3, {ICX}); fused Divide/Add/ReLU post-ops favour oneDNN Graph",
         any_of=(AVX512,)),
    Rule("gemm", "fp32", "onednn",
         "inside oneDNN Graph partitions, with the scale/mask ops fused in: BERT-base with explicit attention at "
         "batch 1 took 235 ms this way and 555 ms with its 24 attention matmuls in torch, though the bare batched "
         f"matmul (12 x 128x64 @ 64x128) is 8-16% faster in torch (0.24-0.26 vs 0.28-0.31 ms), {ZEN3}",
         any_of=(AVX2,)),
    Rule("gemm", "fp32", "torch", f"no AVX2: torch's kernels ({UNMEASURED}; oneDNN 3.2 has only SSE4.1 jit kernels there)"),
    Rule("gemm", "bf16", "onednn",
         f"oneDNN 3.2 bf16 matmul: about 486 GFLOP/s per core, 1.2-1.3x torch's bf16 path; {ZEN5}", any_of=BF16_HW),
    Rule("gemm", "bf16", "torch",
         f"no native bf16: oneDNN 3.2 emulates bf16 from avx512_core (gemm:jit:bf16, about 4x slower than its fp32, "
         f"{ICX}) and refuses it below (dnnl_unimplemented; torch's bf16 matmul 13-17 ms for a 12x128x64x128 "
         f"batch, fp32 0.26, {ZEN3})"),
    Rule("gemm", "int8", "onednn",
         f"u8 x s8 with VNNI: brg:avx512_core_vnni, 504 GFLOP/s at 1024^3 = 2.3x the fp32 peak, {ICX}", any_of=VNNI),
    Rule("gemm", "int8", "fbgemm",
         "without VNNI every x86 int8 kernel adds u8 x s8 pairs in int16 and saturates 8-bit activations (7-bit ones "
         f"are exact: FBGEMM with reduce_range, torch's x86 default); see the linear int8 rows, {ZEN3}", any_of=(AVX2,)),
    Rule("gemm", "int8", "torch", f"no AVX2: torch's reference quantized kernels ({UNMEASURED})"),
    # ---------------------------------------------------------------- linear layers (constant weights)
    Rule("linear", "fp32", "native",
         "a GEMV (1-3 rows, a language model's decode step) under 32M multiply-adds: the time is the weight "
         "stream, and cpu_opt's GEMV reads one contiguous stretch of the weight per thread. ms for 1 row, "
         "weights not in cache, cpu_opt's GEMV / cpu_opt's oneDNN / torch's oneDNN / addmm: 768x2304 (GPT-2 "
         "c_attn) 0.43 / 0.59 / 0.55 / 0.63; 768x3072 0.53 / 0.73 / 0.74 / 0.93; 3072x768 0.55-0.63 / 0.80 / "
         "0.70 / 1.03; 4096x4096 3.8 / 4.4 / 4.8 / 5.5 "
         f"({ZEN3}). The 768x50257 LM head is faster on cpu_opt's oneDNN (7.4-8.6 ms against 9.6-10.8 "
         "for its (N, K) weight): the rule below. Not measured on AVX-512 (run calibrate there), where the "
         "rules below stay", any_of=(AVX2,), none_of=frozenset({"avx512f"}),
         max_rows=LINEAR_TORCH_MIN_ROWS - 1, max_macs=GEMV_NATIVE_MAX_MACS),
    Rule("linear", "fp32", "torch",
         "a small GEMM (under 16M multiply-adds): each oneDNN call costs 30-60 us more than torch's addmm, which "
         "the work does not earn back: 64x128x512 addmm 126 us, torch's oneDNN 171, cpu_opt's 198; 128x256x256 "
         f"146 / 175 / 178; from 128x256x1024 (34M) they tie ({ZEN3}; the cost is per call, not per ISA, but it "
         "was not measured on AVX-512)", any_of=(AVX2,), max_macs=SMALL_GEMM_MACS),
    Rule("linear", "fp32", "torch",
         "a GEMV (1-3 rows) on Intel AVX-512: 1x4096x4096, ms, torch's addmm (MKL sgemv) 1.35, cpu_opt's GEMV 1.41, "
         f"torch's oneDNN 1.56, MKL packed 2.08, cpu_opt's oneDNN 2.96 (calibrate, {XEON_AMX}); GPT-2's decode shapes "
         "with 12 weights rotating (out of cache): 768x2304 addmm 211 us vs MKL packed 227, 3072x768 295 vs 372",
         any_of=(AVX512,), max_rows=LINEAR_TORCH_MIN_ROWS - 1, vendor="GenuineIntel"),
    Rule("linear", "fp32", "mkl",
         "MKL's packed sgemm (mkl::_mkl_linear, what torch.compile's frozen graphs run) against cpu_opt's oneDNN "
         "3.2 (brg:avx512_core, packed) and torch's oneDNN 3.12 (packed) at 128 rows, ms: 768x2304 1.49 / 1.69 / "
         "1.66, 768x3072 2.03 / 2.23 / 2.23, 3072x768 1.99 / 2.21 / 2.22, 768x50257 (GPT-2's LM head) 32.3 / "
         f"35.8 / 36.1, 4096x4096 13.4 / 15.3 / 15.2 ({XEON_AMX}; 10-14% ahead on every shape); end to end at batch 1 "
         "GPT-2 134.8 -> 119.4 ms, BERT-base 90.0 -> 85.1, ViT-B/16 126.9 -> 119.6 (paired in one process). Intel "
         "only: MKL picks its kernels by the CPUID vendor, and on the AMD Zen 5 its sgemm ran at 108 GFLOP/s per core "
         f"against oneDNN's 230 ({ZEN5})", any_of=(AVX512,), min_macs=SMALL_GEMM_MACS,
         min_rows=LINEAR_TORCH_MIN_ROWS, vendor="GenuineIntel"),
    Rule("linear", "fp32", "onednn",
         f"oneDNN 3.2 brg:avx512_core with packed weights: 2-5x torch on transformer shapes, {ZEN5}; level with torch "
         f"on the Ice Lake (128x768x3072: 175 vs 179 GFLOP/s, {ICX}); torch's oneDNN 3.12 never measured against it "
         "on AVX-512 (run calibrate there)", any_of=(AVX512,)),
    Rule("linear", "fp32", "onednn",
         "a GEMV (1-3 rows): MLP 1024-4096-4096-1024-1000 at batch 1 took 7.18 ms with its GEMVs on cpu_opt's "
         f"oneDNN 3.2 and 7.68 ms on torch's oneDNN 3.12 ({ZEN3}; 8 vs 11 ms in November); 1x4096x4096: cpu_opt's "
         f"3.3-4.5 ms, torch's oneDNN 3.4-4.8, MKL 4.2-5.7 ({ZEN3})",
         any_of=(AVX2,), max_rows=LINEAR_TORCH_MIN_ROWS - 1),
    Rule("linear", "fp32", "native_gemm",
         "cpu_opt's packed GEMM (6x16 AVX2 tile, Goto/BLIS blocking) against torch's oneDNN 3.12 on weights "
         "packed for the row count (`python -m bench sgemm`, interleaved medians of 41, ms, 1 / 2 threads): "
         "128x768x768 1.93 / 1.14 vs 2.23 / 1.28; 128x768x3072 8.18 / 4.19 vs 9.22 / 4.92; 128x3072x768 7.43 / "
         "4.39 vs 8.38 / 5.39; 1024x768x3072 58.3 / 32.0 vs 68.1 / 35.5 (1.11-1.23x on every shape; 74-85 "
         f"against 66-74 GFLOP/s per core, {ZEN3_DEC6}; bench/results/sgemm_zen_3.json). Not measured on AVX-512, where the kernel still runs "
         "its AVX2 tile: the rules below stay there", any_of=(AVX2,), none_of=frozenset({"avx512f"}),
         min_rows=LINEAR_TORCH_MIN_ROWS),
    Rule("linear", "fp32", "torch_onednn",
         "pip oneDNN 3.2 has only gemm:jit:f32 on AVX2, torch's oneDNN 3.12 has brg_matmul:avx2: 128x768x3072 "
         f"torch's oneDNN 5.4-5.9 ms, MKL 6.3-8.6, cpu_opt's 9.0-9.7; 2048x768x3072 65-80 / 65-84 / 65-71 ms, a tie "
         f"({ZEN3}); end to end BERT-base 1.21x, ViT-B/16 1.19x at batch 1 ({ZEN3_EARLIER})",
         any_of=(AVX2,)),
    Rule("linear", "fp32", "torch", f"no AVX2: torch's own kernels ({UNMEASURED})"),
    Rule("linear", "bf16", "torch_onednn",
         "with AMX, inside a model (each layer's weights cold in cache, as in every forward pass): torch's oneDNN "
         "3.12 on weights packed for the row count, the GELU or residual add fused, against cpu_opt's oneDNN 3.2 "
         f"Graph partitions (MatMul+GELU / MatMul+Add), timed per call inside the model at batch 1: BERT-base's 49 "
         f"GEMMs 18.5 vs 23.1 ms; end to end (A/B in one process) BERT-base 27.7 -> 23.7 ms, ViT-B/16 39.5 -> 35.8, "
         f"GPT-2 41.4 -> 36.7 ({XEON_AMX}). A lone GEMM hot in cache favours 3.2 (below). GEMVs too: GPT-2 124M "
         "bf16 generate (32 new tokens, decode on 1-row GEMVs) 58.4 -> 61.1 and 60.9 -> 63.0 tokens/s in two A/B "
         "runs", any_of=(frozenset({"amx_bf16"}),)),
    Rule("linear", "bf16", "onednn",
         f"oneDNN 3.2 bf16 matmul with packed weights; {ZEN5}. With AMX (calibrate, {XEON_AMX}), ms: 128x768x3072 "
         "cpu_opt's oneDNN 0.341, torch's oneDNN 0.43, torch 0.451; 1x4096x4096 0.793 / 1.11 / 1.12; at 2048 rows "
         "torch's oneDNN 3.98 vs 4.25 (within the profile's 10% margin)", any_of=BF16_HW),
    Rule("linear", "bf16", "torch",
         f"no native bf16 math: emulated either way; torch's bf16 F.linear 128x768x3072 in 32-43 ms (fp32: 5.4-5.9), "
         f"oneDNN 3.2 and torch's oneDNN refuse bf16 below avx512_core ({ZEN3})"),
    Rule("linear", "int8", "amx",
         "cpu_opt's AMX int8 GEMM (weights packed once in 16-column panels; scale, bias, residual, GELU and a uint8 / "
         "bf16 output in its epilogue) on up to 256 rows. HF BERT-base int8 with every linear layer on it against every "
         "one on oneDNN 3.2's brg:avx512_core_amx, both writing fresh outputs (interleaved calls in one process, "
         "medians): batch 1 (128 rows) 14.53 vs 16.74 and 14.68 vs 16.95 ms (100 calls each); batch 4 (512 rows) "
         "39.5 vs 39.8, level; batch 16 (2048 rows) 127.7 vs 122.9, behind (its 2048-row GEMMs ran at 0.69-1.04x "
         "oneDNN's speed), hence the limit. Layers whose input width is not a multiple of 64 go to oneDNN too (the "
         f"kernel would copy the input); {XEON_AMX_DEC7}",
         any_of=(frozenset({"amx_int8", "amx_tile"}),), max_rows=256),
    Rule("linear", "int8", "onednn",
         f"u8 x s8 with VNNI: brg:avx512_core_vnni, 220 GFLOP/s at 128x768x3072 vs 175 fp32, {ICX}", any_of=VNNI),
    Rule("linear", "int8", "fbgemm",
         "without VNNI (7-bit activations, all candidates exact): FBGEMM 1.2-1.5 ms vs 3.9-5.2 (both oneDNNs) at "
         "1x4096x4096, 2.3-3.2 vs 2.5-3.3 at 128x768x3072; at 2048 rows the oneDNNs win 2 runs in 3 (30-42 vs "
         f"33-45 ms; a profile takes that) ({ZEN3})", any_of=(AVX2,)),
    Rule("linear", "int8", "torch", f"no AVX2: torch's reference quantized kernels ({UNMEASURED})"),
    # ---------------------------------------------------------------- convolution
    Rule("conv", "fp32", "onednn",
         "oneDNN NHWC convolution with packed weights and fused bias/sum/ReLU post-ops (one Graph partition, "
         "3.5e-7 from a float64 reference; shared/KNOWN.md): ResNet-18 at batch 1 took 26.7 ms with its "
         "convolutions in oneDNN partitions and 48.6 ms with them in torch (eager 41.4), though a bare 3x3 conv + "
         f"ReLU (1x64x56x56) is 5-10% faster in torch ({ZEN3})", any_of=(AVX2,)),
    Rule("conv", "fp32", "torch", f"no AVX2: torch's convolution ({UNMEASURED})"),
    Rule("conv", "bf16", "onednn", f"oneDNN bf16 convolution needs avx512_bf16/AMX; {ZEN5}", any_of=BF16_HW),
    Rule("conv", "bf16", "torch",
         f"no native bf16: oneDNN 3.2 refuses bf16 convolution below avx512_core; torch's bf16 3x3 conv 15.7-18.4 ms "
         f"vs 1.9-2.1 fp32 (1x64x56x56, {ZEN3})"),
    Rule("conv", "int8", "onednn",
         "cpu_opt's oneDNN 3.2 convolution, compiled and bound once per input shape, against torch's oneDNN 3.12 "
         "qconv2d_pointwise and FBGEMM on the nine ResNet-50 shapes at batch 1 (u8 in, u8 out + ReLU), summed "
         f"medians of 30 interleaved calls: with AMX 623 / 948 / 2131 us (brgconv:avx512_core_amx), capped to "
         f"avx512_core_vnni 1323 / 1667 / 2247 us (brgconv:avx512_core_vnni); with an input zero point of 128 "
         f"(3.2 then leaves brgconv for a jit kernel with AMX) 922 / 1278 / 2623 and 1529 / 1905 / 2395 us; the "
         f"ResNet stem (3->64, 7x7, stride 2, zero point 128) 204 us vs 299 ({XEON_AMX})",
         any_of=VNNI),
    Rule("conv", "int8", "torch_onednn",
         "no VNNI, 7-bit activations: torch's oneDNN qconv2d fuses the residual add and ReLU into the convolution "
         "and writes uint8 for the next one; HF ResNet-50 int8 at batch 1 took 51.2 ms on it vs 62.0 with FBGEMM "
         "convolutions (fp32 cpu_opt 75.8 in the same run); a bare 1x64x56x56 3x3 conv is a tie (torch's oneDNN "
         f"0.86-1.25 ms, FBGEMM 0.94-1.3) ({ZEN3})", any_of=(AVX2,)),
    Rule("conv", "int8", "torch", f"no AVX2: torch's reference quantized kernels ({UNMEASURED})"),
    # ---------------------------------------------------------------- 3x3 convolutions (stride 1, no groups)
    Rule("conv3x3", "fp32", "native_winograd",
         "cpu_opt's Winograd F(2x2, 3x3) (16 multiplications per output pair and channel pair instead of 36, the "
         "products on the packed GEMM) against oneDNN 3.2's brgconv:avx2 with a fused ReLU on ResNet-50's stride-1 "
         "3x3 layers at batch 1, interleaved medians of 31: 64ch 56x56 1.07 vs 1.50 ms, 128ch 28x28 0.97 vs 1.63, "
         "256ch 14x14 0.81 vs 1.39, 512ch 7x7 1.60 vs 2.21; relative error against float64 2.6-4.5e-7, the direct "
         "convolution's 0.8-1.9e-6. F(4x4, 3x3) (36 instead of 144) where a layer has 36+ 4x4 tiles: 0.61x of "
         "F(2x2)'s time at 56x56, 0.74x at 28x28, 0.91x at 14x14 (error 4-7e-6). Whole models against their "
         "convolutions all in oneDNN (paired, 41 calls): ResNet-18 0.71x the time, HF ResNet-50 0.93x. Layers "
         "with fewer than 36 2x2 tiles (ResNet-50's 7x7 stage: 16 MB of transformed 512x512 weights streamed for "
         f"16 tiles) stay: 0.966x without them against 0.971x with them ({ZEN3_DEC7}). Not measured on AVX-512, "
         "where the rules of `conv` stay",
         any_of=(AVX2,), none_of=frozenset({"avx512f"}), min_macs=WINOGRAD_MIN_MACS, min_rows=WINOGRAD_MIN_TILES),
    *(Rule("conv3x3", d, "conv", "as any convolution: the `conv` route decides", arch="any") for d in DTYPES),
    # ---------------------------------------------------------------- attention
    Rule("attention", "bf16", "torch_flash",
         "with AMX torch's flash-attention kernel runs AMX tiles: 1x12 heads x 256 x 64, flash 0.37 ms vs bf16 "
         f"matmul-softmax-matmul 0.79 (calibrate, {XEON_AMX})", any_of=(frozenset({"amx_bf16"}),)),
    Rule("attention", "bf16", "dpbf16",
         "no AMX, AVX512_BF16: cpu_opt's fused attention kernel on VDPBF16PS, its output rounded to bf16; "
         "BERT-base's 1x12x128x128x64 with a padding mask 0.31-0.40 ms vs bf16 matmul-softmax-matmul 0.67 and torch's "
         f"bf16 flash 0.74, causal 0.41 vs 1.68 / 0.76, batch 16 7.4 vs 17.7 / 14.7 (interleaved medians of 40, {ZEN4}). "
         "Since 2026-12-07 the kernel rounds to bf16 as it stores (no float32 output converted afterwards): the same "
         "shape 213 vs 272 us (medians of 300, 2 threads); end to end, paired in one process, BERT-base 60.33 -> "
         "59.76 ms, GPT-2 88.27 -> 86.53 (the same Zen 4, 2 threads, 2026-12-07)",
         any_of=(frozenset({"avx512_bf16"}),)),
    Rule("attention", "bf16", "bf16_matmul_softmax",
         f"without AMX torch's CPU flash kernel gains nothing from bf16, while bf16 matmul->softmax->matmul is about "
         f"2.7x faster (batch 1, 12 heads, seq 512, dim 64); {ZEN5}", any_of=(frozenset({"avx512_bf16"}),)),
    Rule("attention", "bf16", "torch_flash",
         f"no native bf16 dot products: flash 2.9-3.3 ms vs bf16 matmul-softmax-matmul 58-74 ms (1x12x256x64, {ZEN3})"),
    Rule("attention", "fp32", "f32_fused",
         "AVX-512: cpu_opt's fused float32 attention kernel (dpbf16's algorithm on FMA, q/k/v read where they lie, "
         "the output written in the projection's layout): 1x12 heads x 128^2 x 64 0.38 ms vs torch's flash kernel "
         "0.58, x 197^2 (ViT-B/16) 1.04 vs 1.31, causal 128^2 0.33 vs 0.59 (interleaved medians of 60; AMD EPYC Zen 4, "
         "2 threads, 2026-12-04). From 48 queries: with fewer the call's fixed cost (~60 us) loses to torch's kernel "
         "(12 heads x 64, q/k/v strided views of the projections, interleaved medians of 61, 2 | 1 threads: 1 query x "
         "33 keys 88 vs 35 us | 63 vs 21, 1 x 160 109 vs 40 | 140 vs 51, 32 x 128 150 vs 142 | 234 vs 201, 48 x 128 "
         "171 vs 206 | 281 vs 306, 128 x 128 347 vs 490 | 649 vs 769; the same Zen 4, 2026-12-07)",
         any_of=(native.VARIANT_REQUIRES["avx512"],), min_rows=48),
    Rule("attention", "fp32", "f32_fused",
         "AVX2: the same kernel on 6 x 16 ymm tiles. Against torch's flash kernel, q/k/v strided views of the "
         "projections, interleaved medians of 61, 2 | 1 threads: 1x12 heads x 128^2 x 64 with a padding mask 0.59 "
         "vs 0.87 ms | 1.22 vs 1.30, causal 128^2 0.46 vs 0.85 | 0.90 vs 1.28, 197^2 (ViT-B/16) 1.38 vs 1.85 | 2.91 "
         f"vs 3.15, 512^2 7.97 vs 8.70 | 14.0 vs 14.2 ({ZEN3}, 2026-12-07). Inside the models (per-node timers): "
         "GPT-2's 12 attentions 9.7 vs 11.9 ms, ViT-B/16's 21.0 vs 24.3; whole models level within this VM's noise "
         "(paired, GPT-2 1.007, BERT 0.998). From 12 queries: a one-token decoder step (1 query, 33-160 keys) takes "
         "96-142 us here against torch's 25-39 (the call's Python and k's packing cost more than the work)",
         any_of=(native.VARIANT_REQUIRES["avx2"],), none_of=frozenset({"avx512f"}), min_rows=12),
    Rule("attention", "fp32", "torch_flash",
         "torch's flash kernel avoids materialising the score matrix: 2.0-2.2 ms vs fp32 matmul-softmax-matmul "
         f"2.8-3.2 ms (1x12x256x64, {ZEN3})"),
    # the float attention between the int8 layers of an int8 graph (its matmuls are not quantized)
    Rule("attention", "int8", "amx_bf16",
         "cpu_opt's fused AMX attention kernel (bf16 q/k/v read where they lie, scores on AMX tiles, the softmax in "
         "registers): BERT-base's 12x128x128x64 0.12 ms vs torch's bf16 flash kernel 0.16-0.17 at batch 1, 2.1-2.2 vs "
         f"2.5 ms at batch 16 (interleaved medians, {XEON_AMX})", any_of=(frozenset({"amx_bf16", "amx_tile"}),)),
    Rule("attention", "int8", "dpbf16",
         "no AMX, AVX512_BF16: cpu_opt's fused attention kernel on VDPBF16PS (the AMX kernel's algorithm): BERT-base's "
         "12x128x128x64 0.29 ms vs torch's float32 flash kernel 0.56 (its bf16 flash 0.85) at batch 1, 5.1 vs 10.5 ms at "
         f"batch 16 (interleaved medians of 50, {ZEN4})", any_of=(frozenset({"avx512_bf16"}),)),
    Rule("attention", "int8", "torch_flash",
         "no native bf16 dot products: the attention stays float32 and takes the fp32 attention route (cpu_opt's "
         "fused float32 kernel on AVX-512, torch's flash kernel elsewhere)"),
    # ---------------------------------------------------------------- GNN kernels
    Rule("gnn", "fp32", "native_avx512", "cpu_opt's C kernels, AVX-512 variant",
         any_of=(native.VARIANT_REQUIRES["avx512"],)),
    Rule("gnn", "fp32", "native_avx2", "cpu_opt's C kernels, AVX2 variant", any_of=(native.VARIANT_REQUIRES["avx2"],)),
    Rule("gnn", "fp32", "native_base", "cpu_opt's C kernels, baseline build"),
    Rule("gnn", "bf16", "native_avx512", "bf16 features are widened to fp32 in registers",
         any_of=(native.VARIANT_REQUIRES["avx512"],)),
    Rule("gnn", "bf16", "native_avx2", "bf16 features are widened to fp32 in registers",
         any_of=(native.VARIANT_REQUIRES["avx2"],)),
    Rule("gnn", "bf16", "native_base", "baseline build"),
    Rule("gnn_linear", "fp32", "tall_skinny",
         "100k rows, ms, cpu_opt's tall-skinny GEMM / torch's oneDNN / addmm, K x N: 64x64 6.2 / 6.8 / 11.3, 64x8 2.7 / "
         "3.6 / 5.0, 8x64 1.4 / 2.4 / 4.2, 64x128 14-16 / 44-46 / 47-51; weight gradients (one pass over g and x) "
         f"against mm: 64x64 10.5-12.8 / 14.5-17.2, 64x8 4.2-6.1 / 38-52 ({ZEN3}). Re-measured 2026-12-07 after the "
         "AVX2 tile stopped spilling its accumulators (python -m bench sgemm, cpu_opt / addmm, 1 | 2 threads): 64x64 "
         "10.5 / 12.9 | 7.1 / 8.2, 64x8 2.7 / 5.6 | 1.7 / 4.9, 8x64 2.2 / 4.2 | 1.3 / 2.3, lin_l + lin_r 64+64x64 "
         "22.0 / 43.0 | 15.9 / 32.8; 128x64 against torch's oneDNN 21.7 / 23.3 | 10.7 / 13.1 (so K up to 128 on "
         "AVX2: gnn.pyg.native_linear_max_k)",
         any_of=(AVX2,), none_of=frozenset({"avx512f"})),
    Rule("gnn_linear", "fp32", "tall_skinny",
         "AVX-512: the kernel's 12 x 16 zmm tiles (pairs of panels: 12 x 32), the same sums bit for bit as the AVX2 "
         "tiles. 100k rows, 1 | 2 threads, ms, cpu_opt's tall-skinny GEMM (AVX2 tiles -> AVX-512 tiles) / torch's "
         "oneDNN / addmm: 64x64 10.9 -> 7.6 / 5.4-6.1 / 7.3 | 5.0 -> 3.0-3.3 / 3.0-3.1 / 4.3, 64x128 19.5 -> 14.0 / "
         "13.9 / 31.0 | 10.2 -> 6.8 / 17.6-17.8 / 21.0, 8x64 1.4 / 1.6-2.6 / 2.5 | 0.8-1.0 / 0.7-1.6 / 1.3; lin_l + "
         "lin_r in one output 64x64 + 64x64 19.7 -> 12.6 | 10.0 -> 5.5; weight gradients against mm 64x64 10.6 -> "
         "8.6 / 8.1-8.3 | 5.5 -> 4.0-4.3 / 4.5-4.6. Full-batch training steps against torch's addmm (power-law "
         f"graph, 2 | 1 threads): SAGE-mean 68.8 -> 56.7 | 118.3 -> 106.9 ms, GIN 78.6 -> 66.9 | 139.1 -> 122.1, "
         f"SAGE-max 103.7 -> 87.0, GCN 72.0 -> 68.6 ({XEON_EMR}). On AMD (Zen 4, AVX2 tiles then: 64x64 8.35 / 12.2 "
         "/ 12.7 | 5.24 / 5.45 / 7.59 ms; training 1.10-1.40x faster than with addmm, which is MKL's vendor-picked "
         f"path there; {ZEN4}). The AVX-512 tiles on AMD (the same Zen 4 type, 2026-12-07, AVX2 tiles / AVX-512 "
         "tiles, 1 | 2 threads): 64x64 7.9 / 9.8 | 3.9 / 4.7, 64+64x64 19.0 / 21.0 | 9.5 / 10.5, level at K <= 32 "
         "and for weight gradients: a variant per kernel would gain 10-20% at K = 64 there (Zen 5 not measured)",
         any_of=(AVX512,)),
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




@dataclass(frozen=True)
class Route:
    work: str
    dtype: str
    backend: str
    why: str
    source: str = "table"                  # "table" or "measured" (this machine's profile)


def _check(work: str, dtype: str) -> None:
    if work not in WORK_KINDS:
        raise ValueError(f"unknown work kind {work!r}; expected one of {WORK_KINDS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")


def table_route(work: str, dtype: str, info: hw.CPUInfo | None = None, *, rows: int | None = None,
                macs: int | None = None) -> Route:
    """The routing table's backend for ``work`` at ``dtype`` on this CPU (or on ``info``).
    ``rows`` and ``macs``: a linear layer's activation rows and multiply-adds (the GEMV and the
    small-GEMM rules apply to those only)."""
    _check(work, dtype)
    info = info or hw.detect()
    for r in RULES:
        if r.work == work and r.dtype == dtype and r.applies(info, rows, macs):
            return Route(work, dtype, r.backend, r.why)
    return Route(work, dtype, "torch", "no rule matched: PyTorch's own kernels")


def route(work: str, dtype: str, info: hw.CPUInfo | None = None, *, rows: int | None = None,
          macs: int | None = None) -> Route:
    """The backend for ``work`` at ``dtype``: this machine's measured profile where it has the case
    (``python -m cpu_opt calibrate``), else the table. With an explicit ``info`` (another CPU, a
    fixture) the table alone answers: a profile describes only the machine it was measured on. A
    small GEMM (``macs`` under :data:`SMALL_GEMM_MACS`) is nothing like the profile's shapes: the
    table decides it."""
    _check(work, dtype)
    if info is None and not (macs is not None and macs < SMALL_GEMM_MACS):
        from . import profile

        case = profile.measured(work, dtype, rows)
        if case is not None:
            return Route(work, dtype, case.winner, f"measured here ({case.shape}): {case.figures()}", "measured")
    return table_route(work, dtype, info, rows=rows, macs=macs)


def routes(info: hw.CPUInfo | None = None) -> dict[str, dict[str, dict]]:
    """Every route as ``{work: {dtype: {"backend", "why", "source", "table": {...}, "measured": [...]}}}``:
    the route in force, the table's rule, and the measured cases of this machine's profile (one per
    shape class; empty without a profile or for another CPU's ``info``)."""
    from . import profile

    live = info is None
    info = info or hw.detect()
    prof = profile.load() if live else None
    out: dict[str, dict[str, dict]] = {}
    for w in WORK_KINDS:
        for d in DTYPES:
            if (w == "gnn" and d == "int8") or (w == "gnn_linear" and d != "fp32"):
                continue
            r = route(w, d, None if live else info)
            t = table_route(w, d, info)
            cases = [c for c in (prof.cases if prof else ()) if (c.work, c.dtype) == (w, d)]
            out.setdefault(w, {})[d] = {
                "backend": r.backend, "why": r.why, "source": r.source,
                "table": {"backend": t.backend, "why": t.why},
                "measured": [{"class": c.shape_class, "shape": c.shape, "winner": c.winner, "times_ms": c.times_ms,
                              "excluded": c.excluded,
                              "table": table_route(w, d, info, rows=profile.class_rows(w, c.shape_class)).backend}
                             for c in cases],
            }
    return out


def auto_dtype(info: hw.CPUInfo | None = None) -> str:
    """What ``dtype="auto"`` means here: bf16 where the CPU has native bf16 math, else fp32."""
    info = info or hw.detect()
    if info.arch == "x86_64":
        return "bf16" if info.has("avx512_bf16") or info.has("amx_bf16") else "fp32"
    return "bf16" if info.has("bf16") else "fp32"
