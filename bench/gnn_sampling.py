"""python -m bench gnn_sampling [--quick] [--threads 1,2] [--batches 4]

Neighbour sampling throughput -- sampled nodes per second -- of :func:`cpu_opt.gnn.neighbor_sample`
(native/kernels/sample.c) on a 1M-node R-MAT power-law graph (gnn/rmat.py, seeded; 10M edges),
fan-outs [15, 10, 5], batches of 1024 seed nodes, uniform without replacement, at 1 and 2
threads; and through PyG's ``NeighborLoader`` (``cpu_opt.gnn.install_sampler``) at 1 thread,
which adds PyG's own per-batch work (feature gathering, Data assembly).

Baselines. PyG has no sampler of its own without pyg-lib or torch-sparse (NeighborLoader raises
ImportError), so the baseline is a vectorised pure-torch sampler written here (``torch_sample``:
exact uniform draws without replacement by sorting random keys within each neighbourhood, a dense
map for relabelling) -- what one writes without pyg-lib. torch-sparse's sampler is measured when
torch_sparse is importable: it has no wheel for torch 2.13 and builds from source in about 15
minutes (``pip install --no-build-isolation torch-sparse``), so it is not a dependency.

``--quick``: a 100k-node graph (1M edges), 2 batches. Writes bench/results/gnn_sampling_<cpu>.json
(gnn_sampling_quick_<cpu>.json with --quick).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from bench.runner import RESULTS_DIR, Report, machine_slug, measure


def power_law_csc(n: int, e: int, seed: int = 0):
    """(colptr, row) of an R-MAT graph: for each target, its sources -- what PyG samples over."""
    from cpu_opt.gnn.rmat import rmat_edge_index

    ei = rmat_edge_index(n, e, seed=seed)
    order = torch.argsort(ei[1], stable=True)
    colptr = torch.zeros(n + 1, dtype=torch.int64)
    colptr[1:] = torch.bincount(ei[1], minlength=n).cumsum(0)
    return colptr, ei[0][order].contiguous()


def torch_sample(rowptr, col, seeds, fanouts, gen):
    """Uniform k-hop sampling without replacement in pure torch (the baseline): per hop, every
    neighbourhood of the frontier gets random keys, and the k smallest per node are taken (a sort
    of all frontier neighbours); relabelling through a dense node -> local id map. Returns
    (node, row, col, edge) like cpu_opt.gnn.neighbor_sample."""
    n = rowptr.numel() - 1
    local = torch.full((n,), -1, dtype=torch.int64)
    node = [seeds]
    local[seeds] = torch.arange(seeds.numel())
    count = seeds.numel()
    frontier_local = torch.arange(seeds.numel())
    frontier = seeds
    rows, cols, edges = [], [], []
    for k in fanouts:
        start, deg = rowptr[frontier], rowptr[frontier + 1] - rowptr[frontier]
        owner = torch.repeat_interleave(torch.arange(frontier.numel()), deg)
        first = torch.cumsum(deg, 0) - deg
        pos = torch.arange(owner.numel()) - first[owner] + start[owner]  # every neighbour's CSR position
        if k >= 0:
            key = torch.rand(owner.numel(), generator=gen) + owner.to(torch.float64)  # sort within owner
            order = torch.argsort(key)
            rank = torch.arange(owner.numel()) - first[owner[order]]
            keep = order[rank < k]
            owner, pos = owner[keep], pos[keep]
        nb = col[pos]
        new = nb[local[nb] < 0]
        new_unique = torch.unique(new)  # sorted, not first-seen order: the baseline does not need it
        local[new_unique] = torch.arange(count, count + new_unique.numel())
        count += new_unique.numel()
        node.append(new_unique)
        rows.append(frontier_local[owner])
        cols.append(local[nb])
        edges.append(pos)
        frontier, frontier_local = new_unique, local[new_unique]
    return torch.cat(node), torch.cat(rows), torch.cat(cols), torch.cat(edges)


def _torch_sparse_sampler():
    """``(True, note)`` when torch-sparse's sampler op (``torch.ops.torch_sparse.neighbor_sample``,
    what PyG's NeighborLoader calls without pyg-lib) is loadable, else ``(None, why)``. torch-sparse
    has no wheel for torch 2.13: build it once, outside the venv, e.g. ``pip install --no-deps
    --no-build-isolation --target DIR torch-sparse==0.6.18`` (about 15-40 min on 2 cores) and run the
    bench with ``PYTHONPATH=DIR``. Its Python package also needs torch-scatter; without it the op's
    own library is loaded alone (the sampler does not use torch-scatter)."""
    import importlib.util
    import os.path as osp

    try:
        import torch_sparse

        return True, f"torch_sparse {torch_sparse.__version__}"
    except ImportError as e:
        spec = importlib.util.find_spec("torch_sparse")
        if spec is None or spec.origin is None:
            return None, ("not installed: no wheel for torch 2.13 on PyPI; builds from source in about 15 min "
                          "(pip install --no-build-isolation torch-sparse); not measured")
        why = str(e)
    here = osp.dirname(spec.origin)
    try:
        for lib in ("_version_cpu", "_neighbor_sample_cpu"):
            found = importlib.machinery.PathFinder().find_spec(lib, [here])
            torch.ops.load_library(found.origin)
        torch.ops.torch_sparse.neighbor_sample  # noqa: B018 - the op is there
    except Exception as e2:  # noqa: BLE001
        return None, f"torch_sparse at {here} does not load ({why}; its sampler library alone: {e2}); not measured"
    version = "?"
    try:
        version = open(osp.join(here, "__init__.py")).read().split("__version__ = ")[1].split("\n")[0].strip("'\"")
    except (OSError, IndexError):
        pass
    return True, (f"torch_sparse {version}, built from source here; its sampler op library loaded alone (the "
                  f"package's __init__ needs torch_scatter: {why})")


def main(quick: bool = False, argv=None):
    p = argparse.ArgumentParser(prog="python -m bench gnn_sampling")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--batches", type=int, default=None, help="batches of 1024 seeds per timed call")
    args = p.parse_args(argv or [])
    from cpu_opt import gnn

    threads = [int(t) for t in args.threads.split(",")]
    n, e = (100_000, 1_000_000) if quick else (1_000_000, 10_000_000)
    n_batches = args.batches or (2 if quick else 4)
    fanouts, batch = [15, 10, 5], 1024
    repeats, max_s = (3, 10.0) if quick else (7, 60.0)
    torch_sparse, tsp_note = _torch_sparse_sampler()
    rep = Report("gnn_sampling" + ("_quick" if quick else ""), nodes=n, edges=e, fanouts=fanouts, batch_size=batch,
                 batches_per_call=n_batches, graph="R-MAT a=0.57 b=0.19 c=0.19, seed 0, sampled over the CSC "
                 "(sources of each target), like PyG", torch_sparse=tsp_note, pyg_lib="not installed (no CPU wheel)")
    rep.meta["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]  # the 2 cores are shared
    t0 = time.time()
    colptr, row = power_law_csc(n, e)
    deg = colptr[1:] - colptr[:-1]
    rep.meta["max_in_degree"] = int(deg.max())
    rep.meta["graph_build_s"] = round(time.time() - t0, 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    seed_batches = [perm[i * batch:(i + 1) * batch].contiguous() for i in range(n_batches)]

    def run_cpu_opt():
        return sum(gnn.neighbor_sample(colptr, row, s, fanouts, seed=i).node.numel()
                   for i, s in enumerate(seed_batches))

    gen = torch.Generator().manual_seed(0)

    def run_torch():
        return sum(torch_sample(colptr, row, s, fanouts, gen)[0].numel() for s in seed_batches)

    fns = {"cpu_opt": run_cpu_opt, "torch": run_torch}
    if torch_sparse is not None:
        fns["torch_sparse"] = lambda: sum(torch.ops.torch_sparse.neighbor_sample(colptr, row, s, fanouts, False, True)[0]
                                          .numel() for s in seed_batches)
    old = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            nodes = {k: f() for k, f in fns.items()}  # sampled nodes per call (also a warm-up)
            st = measure(fns, warmup=0, repeats=repeats, max_seconds=max_s)
            for k in fns:
                rep.add(kind="sampler", impl=k, threads=t, ms_per_batch=st[k].median * 1e3 / n_batches,
                        nodes_per_batch=nodes[k] / n_batches, mnodes_per_s=nodes[k] / st[k].median / 1e6,
                        spread_pct=100 * st[k].spread, runs=st[k].runs,
                        speedup_vs_torch=st["torch"].median / st[k].median)
        # the same sampler through PyG's NeighborLoader (1 thread: what a DataLoader worker gets)
        bench_loader(rep, gnn, colptr, row, n, fanouts, batch, n_batches)
    finally:
        torch.set_num_threads(old)
    rep.meta["wall_s"] = round(time.time() - t0, 1)
    rep.meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    rep.print_table(["impl", "threads", "ms_per_batch", "nodes_per_batch", "mnodes_per_s", "speedup_vs_torch"])
    rep.save(RESULTS_DIR / f"{rep.name}_{machine_slug()}.json")  # one file per CPU
    return rep


def bench_loader(rep: Report, gnn, colptr, row, n, fanouts, batch, n_batches):
    import torch_geometric  # noqa: F401
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    torch.set_num_threads(1)
    # a Data whose edge_index is already sorted by target, so PyG's to_csc is a cheap pass
    src = row
    dst = torch.repeat_interleave(torch.arange(n), colptr[1:] - colptr[:-1])
    data = Data(edge_index=torch.stack([src, dst]), x=torch.randn(n, 16), num_nodes=n)
    installed = gnn.install_sampler()
    try:
        loader = NeighborLoader(data, num_neighbors=fanouts, batch_size=batch, is_sorted=True,
                                input_nodes=torch.randperm(n, generator=torch.Generator().manual_seed(2))[
                                    :batch * n_batches])
        list(loader)  # warm-up (builds the CSC once)
        times, nodes = [], 0
        for _ in range(3):
            t0 = time.perf_counter()
            nodes = sum(b.num_nodes for b in loader)
            times.append(time.perf_counter() - t0)
        med = sorted(times)[1]
        rep.add(kind="loader", impl="NeighborLoader+cpu_opt" if installed else "NeighborLoader+pyg_lib", threads=1,
                ms_per_batch=med * 1e3 / n_batches, nodes_per_batch=nodes / n_batches, mnodes_per_s=nodes / med / 1e6)
    finally:
        gnn.uninstall_sampler()


if __name__ == "__main__":
    main()
