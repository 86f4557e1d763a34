"""report() has the same shape everywhere: optimize on x86, the aarch64 path, gnn.optimize."""
import pytest
import torch

import cpu_opt
from cpu_opt.graviton.optimize import ArmOptimizedModule, ArmReport

COMMON = {"capability", "dtype", "num_partitions", "partitions", "fallbacks", "routed", "notes", "validation",
          "counts"}


def _check(rep):
    assert COMMON <= set(rep), COMMON - set(rep)
    assert isinstance(rep["partitions"], list) and isinstance(rep["notes"], list) and isinstance(rep["counts"], dict)
    for f in rep["fallbacks"]:
        assert {"node", "op", "reason"} <= set(f)
    for r in rep["routed"]:
        assert {"node", "op", "route", "why"} <= set(r)


def test_optimize_report():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    rep = cpu_opt.optimize(m, torch.randn(4, 8), dtype="fp32").report()
    _check(rep)
    assert rep["capability"] == "optimize"
    for p in rep["partitions"]:
        assert p["route"] and p["why"]  # the rule that sent its work there, not a constant


def test_graviton_report():
    rep = ArmOptimizedModule(torch.nn.Linear(2, 2), False, ArmReport(
        core="Neoverse V1", core_has_bf16=True, dtype="float32", requested="auto", process_fpmath="f32",
        replaced=[("fc", "ACL packed linear")], left=[("conv", "groups > 1")])).report()
    _check(rep)
    assert rep["capability"] == "graviton" and rep["fallbacks"][0]["reason"] == "groups > 1"


def test_gnn_report():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import SAGEConv

    from cpu_opt import gnn

    fast = gnn.optimize(SAGEConv(4, 4))
    fast(torch.randn(10, 4), torch.randint(0, 10, (2, 30)))
    rep = fast.report()
    _check(rep)
    assert rep["capability"] == "gnn" and rep["counts"]
