"""python -m bench gnn_attention [--quick] [--threads 1,2] [--repeats N]

Training steps (forward, cross-entropy, backward, Adam step) of 2-layer attention GNNs on a
seeded R-MAT power-law graph (gnn/rmat.py; 32,768 nodes, 327,680 edges before PyG's self-loops,
64 features, 8 classes), measured interleaved in one process (bench.runner.measure), at 1 and 2
threads:

* ``pyg``: PyG 2.8's default path (edge_index);
* ``cpu_opt``: ``gnn.optimize(model)`` (GATConv / GATv2Conv / TransformerConv on the fused
  attention kernels, native/kernels/attention.c);
* ``cpu_opt_unfused``: ``gnn.optimize(model, fused_attention=False)``, what gnn.optimize did for
  these layers before (PyG's message passing on cpu_opt's scatter).

Models: the classic GAT (heads 8 x 8 channels, then 1 head; dropout 0.6 on features and attention,
ELU), a wide GAT (heads 8 x 32), GATv2 and TransformerConv in the same shape as the classic GAT,
and the classic GAT without dropout (torch's ``bernoulli_`` is serial on this CPU: the dropout
masks are a fixed cost of both paths, drawn the same way by both). Before timing, each model's
first forward (eval) and loss gradient are compared between ``pyg`` and ``cpu_opt``.
Writes bench/results/gnn_attention_<cpu>.json and gnn_attention_<cpu>.png (<cpu>: machine_slug()).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from bench.gnn import adam_step
from bench.runner import RESULTS_DIR, Report, bar_chart, machine_slug, measure


def _models(f_in: int, classes: int) -> dict:
    from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

    class Net(torch.nn.Module):
        def __init__(self, first, second, p):
            super().__init__()
            self.c1, self.c2, self.p = first, second, p

        def forward(self, x, edge_index):
            x = F.dropout(x, self.p, self.training)
            x = F.elu(self.c1(x, edge_index))
            x = F.dropout(x, self.p, self.training)
            return self.c2(x, edge_index)

    def gat(heads, hidden, p=0.6):
        return Net(GATConv(f_in, hidden, heads=heads, dropout=p), GATConv(heads * hidden, classes, heads=1, dropout=p), p)

    return {
        "GAT (8x8)": lambda: gat(8, 8),
        "GAT wide (8x32)": lambda: gat(8, 32),
        "GATv2 (8x8)": lambda: Net(GATv2Conv(f_in, 8, heads=8, dropout=0.6),
                                   GATv2Conv(64, classes, heads=1, dropout=0.6), 0.6),
        "TransformerConv (8x8)": lambda: Net(TransformerConv(f_in, 8, heads=8, dropout=0.6),
                                             TransformerConv(64, classes, heads=1, dropout=0.6), 0.6),
        "GAT (8x8), no dropout": lambda: gat(8, 8, p=0.0),
    }


def _check(base, x, ei, y) -> dict:
    """max |difference| of the eval forward and of the parameter gradients, pyg against cpu_opt, and
    how many fused attention calls cpu_opt made for it."""
    from cpu_opt import gnn

    ref, opt = copy.deepcopy(base).eval(), copy.deepcopy(base).eval()
    before = _fused_calls(gnn)

    wrapped = gnn.optimize(opt)
    o_r, o_f = ref(x, ei), wrapped(x, ei)
    F.cross_entropy(o_r, y).backward()
    F.cross_entropy(o_f, y).backward()
    grad = max(float((a.grad - b.grad).abs().max()) for a, b in zip(ref.parameters(), opt.parameters()))
    return {"max_abs_diff_out": float((o_r - o_f).detach().abs().max()), "max_abs_diff_grad": grad,
            "fused_calls": _fused_calls(gnn) - before}


def _fused_calls(gnn) -> int:
    from cpu_opt.gnn import pyg

    return sum(v for k, v in pyg._counts.items() if k.startswith("attention:cpu_opt"))


def bench_training(rep: Report, n: int, e: int, f: int, threads, repeats: int, max_seconds: float):
    from cpu_opt import gnn
    from cpu_opt.gnn.rmat import node_task, rmat_edge_index

    classes = 8
    ei = rmat_edge_index(n, e, seed=0)
    x, y = node_task(n, f, classes, ei, seed=0)
    for mname, make in _models(f, classes).items():
        torch.manual_seed(0)
        base = make()
        check = _check(base, x, ei, y)
        models = {"pyg": copy.deepcopy(base), "cpu_opt": copy.deepcopy(base), "cpu_opt_unfused": copy.deepcopy(base)}
        callers = {"pyg": models["pyg"], "cpu_opt": gnn.optimize(models["cpu_opt"]),
                   "cpu_opt_unfused": gnn.optimize(models["cpu_opt_unfused"], fused_attention=False)}
        steps = {pname: adam_step(callers[pname], model.parameters(), x, ei, y, lr=0.005)
                 for pname, model in models.items()}
        for th in threads:
            torch.set_num_threads(th)
            st = measure(steps, warmup=1, repeats=repeats, max_seconds=max_seconds)
            c = st["cpu_opt"].median
            rep.add(model=mname, threads=th, pyg_ms=st["pyg"].median * 1e3, cpu_opt_ms=c * 1e3,
                    cpu_opt_unfused_ms=st["cpu_opt_unfused"].median * 1e3, speedup=st["pyg"].median / c,
                    pyg_min_ms=st["pyg"].min * 1e3, cpu_opt_min_ms=st["cpu_opt"].min * 1e3,
                    spread_pyg=st["pyg"].spread, spread_cpu_opt=st["cpu_opt"].spread, runs=st["cpu_opt"].runs, **check)


def main(quick: bool = False, argv=None):
    p = argparse.ArgumentParser(prog="python -m bench gnn_attention")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv or [])
    threads = [int(t) for t in args.threads.split(",")]
    n, e, f = (8192, 81920, 64) if quick else (32768, 327680, 64)
    repeats = args.repeats or (3 if quick else 7)
    rep = Report("gnn_attention" if not quick else "gnn_attention_quick", nodes=n, edges=e, features=f,
                 graph="R-MAT (a=0.57, b=c=0.19), seed 0, PyG adds self-loops (GAT, GATv2)")
    old = torch.get_num_threads()
    t0 = time.time()
    try:
        bench_training(rep, n, e, f, threads, repeats, 60.0 if not quick else 10.0)
    finally:
        torch.set_num_threads(old)
    rep.meta["wall_s"] = round(time.time() - t0, 1)
    rep.print_table(["model", "threads", "pyg_ms", "cpu_opt_ms", "cpu_opt_unfused_ms", "speedup",
                     "max_abs_diff_out", "max_abs_diff_grad", "fused_calls"])
    rep.save(RESULTS_DIR / f"{rep.name}_{machine_slug()}.json")  # one file per CPU
    if not quick:
        top = max(threads)
        rows = [r for r in rep.rows if r["threads"] == top]
        bar_chart(RESULTS_DIR / f"gnn_attention_{machine_slug()}.png", [r["model"] for r in rows],
                  {"cpu_opt vs PyG": [r["speedup"] for r in rows],
                   "cpu_opt unfused vs PyG": [r["pyg_ms"] / r["cpu_opt_unfused_ms"] for r in rows]},
                  ylabel="train step speedup (x)", title=f"Attention GNN train step, cpu_opt vs PyG 2.8, {top} threads",
                  lines={"target: 3x": 3.0})
    return rep
