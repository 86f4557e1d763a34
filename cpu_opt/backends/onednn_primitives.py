"""cpu_opt's own oneDNN 3.2 binding used op by op (primitives, not Graph partitions): the int8
Linear kernel of the ``onednn`` family (u8 x s8 -> f32 matmul with scales and zero point inside)."""
from __future__ import annotations


from .int8 import LinearKernel, input_u8


class DnnlLinear(LinearKernel):
    """cpu_opt's oneDNN 3.2 int8 matmul (u8 x s8 -> f32, scales and zero point applied inside)."""
    family = "onednn"

    def __init__(self, wq, w_scales, bias, x_qparams, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        from cpu_opt.dnnl.primitives import Matmul

        self.fused_post_op = self.post_op is not None
        self.mm = Matmul(wq.t(), self.bias, [self.post_op] if self.post_op else [], src_scale=self.x_scale,
                         weight_scales=self.w_scales, src_zero_point=self.x_zp)

    def run(self, x, other=None):
        u = input_u8(x, self.x_scale, self.x_zp).contiguous()
        return self._finish(self.mm(u), fused=True)
