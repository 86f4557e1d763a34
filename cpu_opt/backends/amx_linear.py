"""cpu_opt's own int8 linear kernel on AMX tiles (``native/kernels/amx_qlinear.c``): the ``amx`` family
of :mod:`cpu_opt.quant.kernels`, on CPUs with AMX-INT8.

u8 x s8 on TDPBUSD in 2 x 2 blocks of 16 x 16 int32 tiles, the weights packed once into 16-column
panels, each thread streaming its own share of them, and the epilogue (per-channel scale, bias with
the input zero point folded in, a float32 / uint8 / int8 residual, ReLU, GELU, SiLU or hardswish, a
float32, bfloat16 or uint8 output) applied as each block is stored. Why a kernel of our own next to
oneDNN 3.2's ``brg:avx512_core_amx``: at batch 1 a transformer's int8 weights come from memory on
every call (BERT-base: 85 MB) and oneDNN 3.2 does not overlap that stream with its arithmetic (a 768
x 3072 GEMM took 268 us with its weights cold against 170 hot), and its ``gelu_erf`` post-op cost 70
us per FFN GEMM; software prefetch did not buy the overlap here either (the kernel file). Measured on a Xeon with AMX: level with oneDNN on
BERT-base's GEMMs with cold weights (the stream is not overlapped here either); BERT-base int8 at
batch 1 8-10% faster end to end, level at batch 4, 6% slower at batch 16 (the routing table's rule:
up to 256 rows). Any input width runs; the routing sends it only widths that are a multiple of 64
(:func:`supports`: others pay a padded copy of the input)."""
from __future__ import annotations

import torch

from .int8 import LinearKernel, chain_u8, input_u8

_POST = {None: 0, "relu": 1, "gelu_erf": 2, "gelu_tanh": 3, "silu": 4, "hardswish": 5}
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}
_RES_KIND = {torch.float32: 1, torch.uint8: 2, torch.int8: 3}
_NO_AMX = "amx int8 linear: this CPU (or the ISA cap in force) has no AMX-INT8 tiles"


def kernel():
    """The native kernel where this CPU (under the ISA cap in force) has AMX-INT8 tiles, else None."""
    from .attention import _fused_kernel

    return _fused_kernel("amx_qlinear_u8s8")


def supports(in_features: int, post_op) -> bool:
    """Can the ``amx`` family take a layer of this input width and post-op here? (Any width: a width
    that is not a multiple of 64 costs a padded copy of the input per call, so those go elsewhere.)"""
    return in_features > 0 and in_features % 64 == 0 and post_op in _POST and kernel() is not None


def pack_weights(wq: torch.Tensor) -> torch.Tensor:
    """int8 weights (out_features, in_features) -> 16-column panels of 4-byte k groups (the B-tile
    layout of TDPBUSD), zero padded to a multiple of 16 columns and of 64 in_features."""
    n, k = wq.shape
    np_, kp = (n + 15) // 16 * 16, (k + 63) // 64 * 64
    w = torch.zeros(np_, kp, dtype=torch.int8)
    w[:n, :k] = wq
    return w.reshape(np_ // 16, 16, kp // 4, 4).permute(0, 2, 1, 3).contiguous()


class AmxLinear(LinearKernel):
    """An int8 Linear on :mod:`native/kernels/amx_qlinear.c` (see the module docstring)."""
    family = "amx"
    takes_int8_residual = True
    writes_bf16 = True

    def __init__(self, wq, w_scales, bias, x_qparams, **kw):
        if kernel() is None:
            raise RuntimeError(_NO_AMX)
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        if self.post_op not in _POST:
            raise ValueError(f"amx int8 linear: post-op {self.post_op!r} is not one of {sorted(p for p in _POST if p)}")
        self.fused_post_op = self.post_op is not None
        self.in_features = wq.shape[1]
        self.wq_t = wq.t()   # as DnnlLinear keeps it (the int8 graph pass merges parallel layers from it)
        self.wp = pack_weights(wq)
        scale = (self.x_scale * self.w_scales.double()).float()
        colsum = wq.to(torch.int64).sum(1).double()
        b = torch.zeros(self.out_features, dtype=torch.float64) if self.bias is None else self.bias.double()
        # the input zero point folded into the bias: scale (sum (u - zp) w) = scale sum u w - scale zp colsum
        self.k_scale = scale.contiguous()
        self.k_bias = (b - scale.double() * self.x_zp * colsum).float().contiguous()

    def _consts(self):
        """(kernel, packed weights, scales, bias) as cffi pointers, made once per thread (not pickled)."""
        c = getattr(self._tls, "consts", None)
        if c is None:
            from cpu_opt import native

            fn, ffi = kernel(), native.ffi()
            if fn is None:
                raise RuntimeError(_NO_AMX)
            c = self._tls.consts = (fn, ffi.cast("int8_t *", self.wp.data_ptr()),
                                    ffi.cast("float *", self.k_scale.data_ptr()),
                                    ffi.cast("float *", self.k_bias.data_ptr()))
        return c

    def _residual(self, other, rows):
        """(pointer, length, row stride, kind, scale, zero point, tensor) of a residual as the kernel reads
        it; the dtype and qparam checks are the oneDNN family's (:func:`_residual_operand`)."""
        from cpu_opt import native

        from .onednn_primitives import _residual_operand

        if other is None:
            return native.ffi().NULL, 0, 0, 0, 1.0, 0, None
        r = _residual_operand(other, self.other_qparams).reshape(rows, self.out_features)
        if r.stride(-1) != 1 or r.stride(0) < self.out_features:
            r = r.contiguous()
        kind, (s, z) = _RES_KIND[r.dtype], (self.other_qparams if r.dtype != torch.float32 else (1.0, 0))
        return native.ffi().cast("void *", r.data_ptr()), (rows - 1) * r.stride(0) + self.out_features if rows else 0, \
            r.stride(0), kind, float(s), int(z), r

    def run(self, x, other=None):
        from cpu_opt import native

        u = input_u8(x, self.x_scale, self.x_zp)
        lead = u.shape[:-1]
        u2 = u.reshape(-1, u.shape[-1])
        if u2.stride(-1) != 1:
            u2 = u2.contiguous()
        rows = u2.shape[0]
        res_p, res_len, ldr, res_kind, rs, rz, keep = self._residual(other, rows)
        if self.out_qparams is not None:
            dtype, (os_, oz) = torch.uint8, self.out_qparams
        else:
            dtype, os_, oz = self.float_out, 1.0, 0
        # always a fresh output, even where the runtime allows reusing one (reuse_output), as DnnlLinear's: a
        # buffer kept per layer is cold by the time the layer runs again, a fresh one comes back hot from the
        # allocator (HF BERT-base int8 at batch 1, Xeon with AMX, paired: 16.13 -> 14.92, 16.41 -> 14.97 ms)
        y = torch.empty(rows, self.out_features, dtype=dtype)
        ffi = native.ffi()
        fn, wp, sc, bi = self._consts()
        x_len = (rows - 1) * u2.stride(0) + u2.shape[1] if rows else 0
        st = fn(ffi.cast("uint8_t *", u2.data_ptr()), x_len, rows, self.in_features, u2.stride(0),
                      wp, self.wp.numel(), self.out_features, sc, bi,
                      res_p, res_len, ldr, res_kind, rs, rz, _POST[self.post_op],
                      ffi.cast("void *", y.data_ptr()), y.numel(), self.out_features, _OUT_KIND[dtype],
                      float(os_), int(oz), torch.get_num_threads())
        del keep
        native.check(st, "amx_qlinear_u8s8")
        y = y.reshape(*lead, self.out_features)
        return chain_u8(y) if self.out_qparams is not None else y

    def __deepcopy__(self, memo):
        """Immutable once built (packed weights): shared."""
        return self

