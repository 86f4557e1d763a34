"""python -m bench gnn [--quick] [--threads 1,2] [--skip-training] [--pyg-extensions] [--gather-ceiling]

cpu_opt.gnn kernels and PyG training epochs against the honest stock-torch baselines, measured
interleaved in one process (bench.runner.measure), at 1 and 2 threads:

* spmm (CSR x dense; sum, mean, amax, amin), forward and forward+backward, against
  ``torch.sparse.mm(csr, x, reduce=...)``; effective memory bandwidth of the forward (bytes of
  gathered neighbour rows + output + indices, per second) against the machine's copy bandwidth
  measured in the same run;
* scatter_reduce of per-edge messages (E x F) to nodes against ``Tensor.scatter_reduce``
  (include_self=False), and gather against ``index_select``, forward and forward+backward;
* training epochs (forward, cross-entropy, backward, Adam step; no dropout, so the kernels are not
  hidden behind ``bernoulli_``) of GraphSAGE-mean, GraphSAGE-max, GCN and GIN: cpu_opt
  (``gnn.optimize``) against PyG's default ``edge_index`` path and PyG with a torch CSR ``adj_t``.

``--gather-ceiling`` measures only how fast the spmm kernel reads x rows in random order against
in order (the ceiling the uniform graph works under). ``--pyg-extensions`` instead compares scatter with ``torch_scatter.scatter`` and spmm with
``torch_sparse.matmul`` (PyG's former C++ extensions), those of them installed: there are no
wheels for torch 2.13, they build from source (``pip install --no-build-isolation torch-scatter
torch-sparse``, 7-15 min of both cores each), so they are not dependencies of cpu_opt.

Graphs: 100k nodes, 1M edges, 64 features (``--quick``: 20k nodes, 200k edges), uniform and R-MAT
power-law (gnn/rmat.py, seeded). Writes bench/results/gnn_<cpu>.json and gnn_kernels_<cpu>.png /
gnn_training_<cpu>.png (<cpu>: bench.runner.machine_slug(), e.g. zen_3), so runs on other CPUs stay.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from bench.runner import RESULTS_DIR, Report, bar_chart, machine_slug, measure, memory_bandwidth_gbs


def _graphs(n, e, seed=0):
    from cpu_opt.gnn.rmat import rmat_edge_index, uniform_edge_index

    return {"uniform": uniform_edge_index(n, e, seed=seed), "powerlaw": rmat_edge_index(n, e, seed=seed)}


def _torch_reduce(r):
    return {"sum": "sum", "mean": "mean", "amax": "amax", "amin": "amin"}[r]


def _versus(rep: Report, fns: dict, *, baseline: str, repeats, max_seconds, fwd_bytes=None, bw=None, **row):
    """Measure a baseline and cpu_opt, forward and forward+backward, interleaved (``fns``: the
    callables "base", "cpu_opt", "base_fb", "cpu_opt_fb"), and add a kernel row per mode; the
    forward row gets its effective bandwidth when ``fwd_bytes`` is given."""
    st = measure(fns, warmup=1, repeats=repeats, max_seconds=max_seconds)
    for mode, a, b in (("fwd", "cpu_opt", "base"), ("fwd+bwd", "cpu_opt_fb", "base_fb")):
        r = dict(kind="kernel", **row, mode=mode, cpu_opt_ms=st[a].median * 1e3, torch_ms=st[b].median * 1e3,
                 speedup=st[b].median / st[a].median, baseline=baseline)
        if mode == "fwd" and fwd_bytes is not None:
            r["gbs"] = fwd_bytes / st[a].median / 1e9
            r["pct_bw"] = 100 * r["gbs"] / bw
        rep.add(**r)


def bench_kernels(rep: Report, n, e, f, threads, repeats, max_seconds, graphs):
    from cpu_opt import gnn

    for gname, ei in graphs.items():
        g = gnn.CSRGraph.from_edge_index(ei, n)
        g.csc()  # built once per graph (cached); not part of the timed calls
        csr = torch.sparse_csr_tensor(g.rowptr, g.col, torch.ones(g.nnz), (n, n))
        x = torch.randn(n, f)
        xg = x.clone().requires_grad_()
        go = torch.randn(n, f)
        dst, src = ei[1].contiguous(), ei[0].contiguous()
        msg = torch.randn(e, f)
        msgg = msg.clone().requires_grad_()
        go_msg = torch.randn(e, f)
        dst_exp = dst.view(-1, 1).expand(-1, f)
        gnn.sort_cache.get(dst, n)  # the same index comes every epoch: sorted once
        for th in threads:
            torch.set_num_threads(th)
            bw = memory_bandwidth_gbs(repeats=5)
            rep.add(kind="machine", graph=gname, threads=th, op="copy bandwidth", gbs=round(bw, 1))
            for r in ("sum", "mean", "amax", "amin"):
                tr = _torch_reduce(r)

                def t_fwd(tr=tr):
                    return torch.sparse.mm(csr, x) if tr == "sum" else torch.sparse.mm(csr, x, tr)

                def t_fb(tr=tr):
                    xg.grad = None
                    out = torch.sparse.mm(csr, xg) if tr == "sum" else torch.sparse.mm(csr, xg, tr)
                    out.backward(go)

                def c_fb(r=r):
                    xg.grad = None
                    gnn.spmm(g, xg, r).backward(go)

                # x needs no gradient in the timed forward, so max/min keep no winners: same bytes for all
                nbytes = e * f * 4 + n * f * 4 + e * g.col.element_size() + (n + 1) * 8
                _versus(rep, {"base": t_fwd, "cpu_opt": lambda r=r: gnn.spmm(g, x, r), "base_fb": t_fb,
                              "cpu_opt_fb": c_fb}, baseline="torch.sparse.mm(csr)", repeats=repeats,
                        max_seconds=max_seconds, fwd_bytes=nbytes, bw=bw, graph=gname, threads=th, op=f"spmm_{r}")
            for r in ("sum", "mean", "amax", "amin"):
                def t_fwd(r=r):
                    return torch.zeros(n, f).scatter_reduce(0, dst_exp, msg, r, include_self=False)

                def t_fb(r=r):
                    msgg.grad = None
                    torch.zeros(n, f).scatter_reduce(0, dst_exp, msgg, r, include_self=False).backward(go)

                def c_fb(r=r):
                    msgg.grad = None
                    gnn.scatter(msgg, dst, 0, n, r).backward(go)

                _versus(rep, {"base": t_fwd, "cpu_opt": lambda r=r: gnn.scatter(msg, dst, 0, n, r),
                              "base_fb": t_fb, "cpu_opt_fb": c_fb}, baseline="Tensor.scatter_reduce",
                        repeats=repeats, max_seconds=max_seconds, graph=gname, threads=th, op=f"scatter_{r}")

            def t_fb():
                xg.grad = None
                x_ = xg.index_select(0, src)
                x_.backward(go_msg)

            def c_fb():
                xg.grad = None
                gnn.gather(xg, src).backward(go_msg)

            out_buf = torch.empty(e, f)
            _versus(rep, {"base": lambda: torch.index_select(x, 0, src, out=out_buf),
                          "cpu_opt": lambda: gnn.gather(x, src, out=out_buf), "base_fb": t_fb, "cpu_opt_fb": c_fb},
                    baseline="index_select", repeats=repeats, max_seconds=max_seconds,
                    fwd_bytes=2 * e * f * 4 + e * 8, bw=bw, graph=gname, threads=th, op="gather")


def bench_torch_scatter(rep: Report, n, e, f, threads, repeats, max_seconds, graphs):
    """cpu_opt's scatter against torch_scatter (PyG's former C++ extension), when it is installed:
    it is not on PyPI as a wheel for torch 2.13 and builds from source (pip install --no-build-isolation
    torch-scatter, about 7 min of both cores here)."""
    import torch_scatter

    from cpu_opt import gnn

    for gname, ei in graphs.items():
        dst = ei[1].contiguous()
        msg = torch.randn(e, f)
        msgg = msg.clone().requires_grad_()
        go = torch.randn(n, f)
        gnn.sort_cache.get(dst, n)
        for th in threads:
            torch.set_num_threads(th)
            for r, ts_r in (("sum", "sum"), ("mean", "mean"), ("amax", "max"), ("amin", "min")):
                def t_fwd(ts_r=ts_r):
                    return torch_scatter.scatter(msg, dst, 0, None, n, ts_r)

                def t_fb(ts_r=ts_r):
                    msgg.grad = None
                    torch_scatter.scatter(msgg, dst, 0, None, n, ts_r).backward(go)

                def c_fb(r=r):
                    msgg.grad = None
                    gnn.scatter(msgg, dst, 0, n, r).backward(go)

                _versus(rep, {"base": t_fwd, "cpu_opt": lambda r=r: gnn.scatter(msg, dst, 0, n, r),
                              "base_fb": t_fb, "cpu_opt_fb": c_fb}, baseline="torch_scatter.scatter",
                        repeats=repeats, max_seconds=max_seconds, graph=gname, threads=th, op=f"scatter_{r}")


def bench_torch_sparse(rep: Report, n, e, f, threads, repeats, max_seconds, graphs):
    """cpu_opt's spmm against torch_sparse's ``matmul(SparseTensor, x, reduce)`` (PyG's former
    sparse backend), when it is installed (built from source: about 15 min of both cores here)."""
    import torch_sparse

    from cpu_opt import gnn

    for gname, ei in graphs.items():
        g = gnn.CSRGraph.from_edge_index(ei, n)
        g.csc()
        adj = torch_sparse.SparseTensor(rowptr=g.rowptr, col=g.col, sparse_sizes=(n, n))
        adj.storage.csr2csc()  # its transpose for backward, built once like cpu_opt's (not timed)
        x = torch.randn(n, f)
        xg = x.clone().requires_grad_()
        go = torch.randn(n, f)
        for th in threads:
            torch.set_num_threads(th)
            for r, ts_r in (("sum", "sum"), ("mean", "mean"), ("amax", "max"), ("amin", "min")):
                def t_fb(ts_r=ts_r):
                    xg.grad = None
                    torch_sparse.matmul(adj, xg, ts_r).backward(go)

                def c_fb(r=r):
                    xg.grad = None
                    gnn.spmm(g, xg, r).backward(go)

                _versus(rep, {"base": lambda ts_r=ts_r: torch_sparse.matmul(adj, x, ts_r),
                              "cpu_opt": lambda r=r: gnn.spmm(g, x, r), "base_fb": t_fb, "cpu_opt_fb": c_fb},
                        baseline="torch_sparse.matmul", repeats=repeats, max_seconds=max_seconds,
                        graph=gname, threads=th, op=f"spmm_{r}")


def bench_gather_order(rep: Report, n, e, f, threads, repeats, max_seconds):
    """How fast the spmm kernel itself reads e rows of x (n x f) in random order with almost no
    output (1000 rows of 1000 nonzeros each), against the same e rows read in order, and the copy
    bandwidth of the same moment: the ceiling the uniform graph's spmm works under."""
    from cpu_opt import gnn

    x = torch.randn(n, f)
    cols = torch.randint(0, n, (e,), generator=torch.Generator().manual_seed(1))
    per_row = 1000
    random_order = gnn.CSRGraph(torch.arange(0, e + 1, per_row), cols, n)
    in_order = gnn.CSRGraph(torch.arange(0, e + 1, per_row), torch.arange(e) % n, n)
    gathered = e * f * x.element_size()
    for th in threads:
        torch.set_num_threads(th)
        bw = memory_bandwidth_gbs(repeats=5)
        st = measure({"random": lambda: gnn.spmm(random_order, x), "in order": lambda: gnn.spmm(in_order, x)},
                     repeats=repeats, max_seconds=max_seconds)
        for name in ("random", "in order"):
            gbs = gathered / st[name].median / 1e9
            rep.add(kind="machine", graph="-", threads=th, op=f"spmm reading x rows {name}", gbs=round(gbs, 1),
                    pct_bw=100 * gbs / bw, copy_gbs=round(bw, 1), ms=st[name].median * 1e3)


def _models(f_in, hidden, classes):
    from torch_geometric.nn import GCNConv, GINConv, SAGEConv

    class Net(torch.nn.Module):
        def __init__(self, make):
            super().__init__()
            self.c1, self.c2 = make(f_in, hidden), make(hidden, classes)

        def forward(self, x, edge_index):
            return self.c2(self.c1(x, edge_index).relu(), edge_index)

    def gin(i, o):
        return GINConv(torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o)))

    return {
        "GraphSAGE-mean": lambda: Net(lambda i, o: SAGEConv(i, o, aggr="mean")),
        "GraphSAGE-max": lambda: Net(lambda i, o: SAGEConv(i, o, aggr="max")),
        "GCN": lambda: Net(GCNConv),
        "GIN": lambda: Net(gin),
    }


def adam_step(call, params, x, graph, y, lr: float):
    """A full-batch training step of ``call(x, graph)`` (cross-entropy against ``y``, Adam)."""
    opt = torch.optim.Adam(params, lr=lr)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(call(x, graph), y)
        loss.backward()
        opt.step()
        return loss

    return step


def bench_training(rep: Report, n, e, f, threads, repeats, max_seconds, graphs):
    from cpu_opt import gnn
    from cpu_opt.gnn.rmat import node_task

    classes, hidden = 8, 64
    for gname, ei in graphs.items():
        x, y = node_task(n, f, classes, ei, seed=0)
        adj_t = gnn.CSRGraph.from_edge_index(ei, n).to_torch()  # PyG's torch CSR adj_t (targets x sources)
        for mname, make in _models(f, hidden, classes).items():
            torch.manual_seed(0)
            base = make()
            paths = {"pyg_edge_index": (copy.deepcopy(base), ei), "pyg_csr_adj_t": (copy.deepcopy(base), adj_t)}
            m_fast = copy.deepcopy(base)
            paths["cpu_opt"] = (gnn.optimize(m_fast), ei)
            steps = {}
            for pname, (model, graph_arg) in paths.items():
                params = (m_fast if pname == "cpu_opt" else model).parameters()
                steps[pname] = adam_step(model, params, x, graph_arg, y, lr=0.01)
            for th in threads:
                torch.set_num_threads(th)
                st = measure(steps, warmup=1, repeats=repeats, max_seconds=max_seconds)
                c = st["cpu_opt"].median
                rep.add(kind="training", graph=gname, threads=th, op=mname, mode="epoch",
                        cpu_opt_ms=c * 1e3, pyg_edge_index_ms=st["pyg_edge_index"].median * 1e3,
                        pyg_csr_ms=st["pyg_csr_adj_t"].median * 1e3,
                        speedup_vs_edge_index=st["pyg_edge_index"].median / c,
                        speedup_vs_csr=st["pyg_csr_adj_t"].median / c)


def _charts(rep: Report, threads: int):
    rows = [r for r in rep.rows if r["kind"] == "kernel" and r["threads"] == threads]
    if rows:
        _kernel_chart(rows, threads)
    trows = [r for r in rep.rows if r["kind"] == "training" and r["threads"] == threads]
    if trows:
        labels = [f"{r['op']} ({r['graph']})" for r in trows]
        bar_chart(RESULTS_DIR / f"gnn_training_{machine_slug()}.png", labels,
                  {"vs PyG edge_index": [r["speedup_vs_edge_index"] for r in trows],
                   "vs PyG torch-CSR adj_t": [r["speedup_vs_csr"] for r in trows]},
                  ylabel="epoch speedup (x)", title=f"PyG training epoch, cpu_opt vs PyG, {threads} threads",
                  lines={"target vs CSR adj_t: 3x": 3.0, "target vs edge_index: 5x": 5.0})


def _kernel_chart(rows, threads: int):
    labels = sorted({f"{r['op']} {r['mode']}" for r in rows}, key=lambda s: (s.split()[0], s.split()[1]))
    series = {}
    for gname in ("uniform", "powerlaw"):
        d = {f"{r['op']} {r['mode']}": r["speedup"] for r in rows if r["graph"] == gname}
        series[gname] = [d.get(lab, 0.0) for lab in labels]
    bar_chart(RESULTS_DIR / f"gnn_kernels_{machine_slug()}.png", labels, series, ylabel="speedup over stock torch (x)",
              title=f"cpu_opt.gnn kernels vs torch, {threads} threads (100k nodes, 1M edges, F=64)", log=True,
              lines={"target: spmm fwd+bwd 2x": 2.0, "target: spmm max/min fwd+bwd 3x": 3.0})


def main(quick: bool = False, argv=None):
    p = argparse.ArgumentParser(prog="python -m bench gnn")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--gather-ceiling", action="store_true",
                   help="only the random-order read ceiling of the spmm kernel (writes gnn_gather_ceiling.json)")
    p.add_argument("--pyg-extensions", action="store_true",
                   help="instead of the default set: compare with torch_scatter / torch_sparse, those of them "
                        "installed (writes gnn_pyg_extensions.json)")
    args = p.parse_args(argv or [])
    threads = [int(t) for t in args.threads.split(",")]
    n, e, f = (20_000, 200_000, 64) if quick else (100_000, 1_000_000, 64)
    repeats, max_s = (3, 5.0) if quick else (5, 20.0)
    old = torch.get_num_threads()
    try:
        import torch_scatter
        ts_note = f"torch_scatter {torch_scatter.__version__} (built from source here)"
    except ImportError:
        torch_scatter = None
        ts_note = ("not installed: no wheel for torch 2.13 on PyPI; builds from source "
                   "(pip install --no-build-isolation torch-scatter, ~7 min of both cores)")
    try:
        import torch_sparse
        tsp_note = f"torch_sparse {torch_sparse.__version__} (built from source here)"
    except ImportError:
        torch_sparse = None
        tsp_note = ("not installed: no wheel for torch 2.13 on PyPI; builds from source "
                    "(pip install --no-build-isolation torch-sparse, ~15 min of both cores)")
    rep = Report("gnn" if not quick else "gnn_quick", nodes=n, edges=e, features=f, torch_scatter=ts_note,
                 torch_sparse=tsp_note)
    if args.pyg_extensions:
        rep.name = "gnn_pyg_extensions"
    if args.gather_ceiling:
        rep.name = "gnn_gather_ceiling"
    if args.skip_kernels and not args.skip_training and not quick:
        rep.name = "gnn_training"  # the training rows alone: gnn.json keeps the full run
    t0 = time.time()
    graphs = _graphs(n, e)
    try:
        if args.gather_ceiling:
            bench_gather_order(rep, n, e, f, threads, max(repeats, 11), max_s)
        elif args.pyg_extensions:
            if torch_scatter is None and torch_sparse is None:
                raise SystemExit("--pyg-extensions: neither torch_scatter nor torch_sparse is installed")
            if torch_scatter is not None:
                bench_torch_scatter(rep, n, e, f, threads, repeats, max_s, graphs)
            if torch_sparse is not None:
                bench_torch_sparse(rep, n, e, f, threads, repeats, max_s, graphs)
        elif not args.skip_kernels:
            bench_kernels(rep, n, e, f, threads, repeats, max_s, graphs)
            bench_gather_order(rep, n, e, f, threads, repeats, max_s)
        if not args.skip_training and not args.pyg_extensions and not args.gather_ceiling:
            bench_training(rep, n, e, f, threads, max(3, repeats - 2), max_s, graphs)
    finally:
        torch.set_num_threads(old)
    rep.meta["wall_s"] = round(time.time() - t0, 1)
    k = [r for r in rep.rows if r["kind"] == "kernel"]
    if k:
        Report.print_table(_subset(rep, k), ["graph", "threads", "op", "mode", "cpu_opt_ms", "torch_ms", "speedup",
                                             "gbs", "pct_bw", "baseline"])
    m = [r for r in rep.rows if r["kind"] == "machine"]
    if m:
        Report.print_table(_subset(rep, m), ["graph", "threads", "op", "gbs", "pct_bw", "copy_gbs"])
    t = [r for r in rep.rows if r["kind"] == "training"]
    if t:
        Report.print_table(_subset(rep, t), ["graph", "threads", "op", "cpu_opt_ms", "pyg_edge_index_ms",
                                             "pyg_csr_ms", "speedup_vs_edge_index", "speedup_vs_csr"])
    rep.save(RESULTS_DIR / f"{rep.name}_{machine_slug()}.json")  # one file per CPU
    if not quick and not args.pyg_extensions and not args.gather_ceiling:
        _charts(rep, max(threads))
    return rep


def _subset(rep: Report, rows):
    sub = copy.copy(rep)
    sub.rows = rows
    return sub
