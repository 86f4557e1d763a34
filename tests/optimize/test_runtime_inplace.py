"""A partition whose residual add oneDNN fuses as a sum post-op writes its output into the residual's
buffer when no later step reads it (``runtime._donate_dead_inputs``): the same answers as eager on
every call, nothing returned is overwritten later, and the donation really happens (the partition
is handed one buffer as both the residual and its output)."""
import pytest
import torch
from torch import nn

import cpu_opt
import optimize_testutil
from cpu_opt.backends.onednn_graph import PartitionStep
from cpu_opt.dnnl import graph as G


class Residual(nn.Module):
    """r = relu(conv_a(x)); t = cumsum(r) in torch (no oneDNN mapping: the partitions split there),
    channels-last as r (oneDNN runs an add in place only where both operands share a layout);
    relu(conv_b(t) + r), where r is read last by the second partition, and r itself returned when
    ``keep`` (then a caller sees r: it is a new buffer every call and never overwritten)."""

    def __init__(self, keep: bool = False):
        super().__init__()
        self.a = nn.Conv2d(8, 8, 1)
        self.b = nn.Conv2d(8, 8, 1)
        self.keep = keep

    def forward(self, x):
        r = torch.relu(self.a(x))
        t = torch.cumsum(r, dim=1).contiguous(memory_format=torch.channels_last)
        y = torch.relu(self.b(t) + r)
        y = torch.cumsum(y, dim=2)   # in torch too: the second partition's output stays internal
        return (y, r) if self.keep else y


def _spy(monkeypatch):
    """Record, per compiled-partition call, whether some output was handed an input's memory."""
    shared = []
    real = G.CompiledPartition.run_unchecked

    def run(self, inputs, outputs):
        shared.append(any(o.data_ptr() == i.data_ptr() for o in outputs for i in inputs))
        return real(self, inputs, outputs)

    monkeypatch.setattr(G.CompiledPartition, "run_unchecked", run)
    return shared


@pytest.mark.parametrize("keep", [False, True])
def test_a_dead_residual_takes_the_partitions_output(monkeypatch, keep):
    if not optimize_testutil.conv_on_onednn():
        pytest.skip("convolutions are not routed to oneDNN Graph on this CPU / cap: no partition to run in place")
    torch.manual_seed(0)
    m = Residual(keep).eval()
    x = torch.randn(2, 8, 6, 6)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    shared = _spy(monkeypatch)
    with torch.no_grad():
        outs = []
        for xx in (x, torch.randn(2, 8, 6, 6), x):
            got, ref = opt(xx), m(xx)
            got, ref = (got, ref) if keep else ((got,), (ref,))
            for g, r in zip(got, ref):
                assert ((g - r).abs().max() / r.abs().max()).item() < 1e-5
            outs.append([g.clone() for g in got])
        # a returned tensor is never a buffer a later call writes into
        assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[2]))
    steps = [n.target for n in next(iter(opt._plans.values())).program.graph.nodes
             if n.op == "call_function" and isinstance(n.target, PartitionStep)]
    donating = [s for s in steps if s.donate]
    if keep:
        assert not donating and not any(shared)   # r is returned: never overwritten
    else:
        assert len(donating) == 1 and any(shared)
        cps = list(donating[0]._compiled.values())
        assert cps and cps[0].inplace   # the fused add really is an in-place sum post-op
