"""python -m bench gnn_distributed [--quick] [--procs 1,2] [--steps 50] [--optimize]

Epoch time of mini-batch GraphSAGE training (cpu_opt.gnn.distributed: gloo + DDP, each rank
sampling its share of the seeds with cpu_opt's sampler through PyG's NeighborLoader) with 1 and 2
processes of 1 thread each (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), on localhost.

Graph: the 1M-node R-MAT power-law graph of bench/gnn_sampling.py (``power_law_csc``: 10M
edges, seed 0), 64 random features, 16 classes; built once here, saved to a temporary file and
memory-mapped by every rank (``torch.load(mmap=True)``: one copy in the page cache). Model:
GraphSAGE, 2 layers, 64 -> 128 -> 16, mean aggregation, Adam; fan-outs [10, 5]; 1024 seed nodes
per rank per step; every node is a seed, so a full epoch is ceil(1M / (1024 * procs)) steps per
rank (977 with one process, 489 with two).

A full epoch is not run: each rank takes ``--warmup`` steps (not timed; the first builds PyG's CSC
of the graph), then ``--steps`` timed steps (default 50). The time per step is the slowest rank's
(the all-reduce keeps them in step); the projected epoch time is that times the full epoch's
step count. ``--rounds`` (default 3) runs of each world size, alternating 1, 2, 1, 2...; the
table gives the median run, the JSON all of them. Each rank also times 20 all-reduces of a
tensor the size of the gradients, which is what DDP adds per step. The load average before and
after each run goes into the JSON: on a VM whose 2 vCPUs are shared, other jobs change the result.

``--quick``: the 100k-node graph (1M edges), 3 warm-up and 10 timed steps, 1 round. Writes
bench/results/gnn_distributed_<cpu>.json (gnn_distributed_quick_<cpu>.json with --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.runner import RESULTS_DIR, Report, machine_slug

ROOT = Path(__file__).resolve().parent.parent
FEATURES, HIDDEN, CLASSES = 64, 128, 16


def build_graph(n: int, e: int, path: Path) -> dict:
    """The graph of bench/gnn_sampling.py as a PyG-style dict (edge_index sorted by target, so
    NeighborLoader(is_sorted=True) takes it as it is), saved to ``path``."""
    from bench.gnn_sampling import power_law_csc

    colptr, row = power_law_csc(n, e)
    dst = torch.repeat_interleave(torch.arange(n), colptr[1:] - colptr[:-1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    torch.save({"edge_index": torch.stack([row, dst]), "x": x, "y": y}, path)
    return {"max_in_degree": int((colptr[1:] - colptr[:-1]).max())}


def _loadavg():
    return [round(v, 2) for v in os.getloadavg()]


def run_world(world: int, graph: Path, out: Path, args) -> list:
    """Start ``world`` ranks of this file (1 thread each) and return their results."""
    from cpu_opt.gnn.distributed import free_port

    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "bench.gnn_distributed", "--worker", str(graph), str(out / f"w{world}_r{r}.json"),
               str(args.warmup), str(args.steps), ",".join(map(str, args.fanouts)), str(args.batch),
               "1" if args.optimize else "0"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=str(ROOT)))
    try:
        rcs = [p.wait(timeout=args.run_timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(rcs):
        raise RuntimeError(f"gnn_distributed: a rank of the {world}-process run failed (exit codes {rcs})")
    return [json.loads((out / f"w{world}_r{r}.json").read_text()) for r in range(world)]


def main(quick: bool = False, argv=None):
    p = argparse.ArgumentParser(prog="python -m bench gnn_distributed")
    p.add_argument("--procs", default="1,2")
    p.add_argument("--steps", type=int, default=None, help="timed steps per rank (default 50; 10 with --quick)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--fanouts", default="10,5")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--optimize", action="store_true", help="train gnn.optimize(model) inside DDP")
    p.add_argument("--rounds", type=int, default=None,
                   help="runs per world size, alternating (default 3; 1 with --quick)")
    p.add_argument("--run-timeout", type=float, default=1800.0)
    args = p.parse_args(argv or [])
    args.fanouts = [int(f) for f in args.fanouts.split(",")]
    args.steps = args.steps or (10 if quick else 50)
    args.rounds = args.rounds or (1 if quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if quick else 5)
    n, e = (100_000, 1_000_000) if quick else (1_000_000, 10_000_000)
    procs = [int(w) for w in args.procs.split(",")]
    rep = Report("gnn_distributed" + ("_quick" if quick else ""), nodes=n, edges=e, fanouts=args.fanouts,
                 batch_size_per_rank=args.batch, model=f"GraphSAGE {FEATURES}->{HIDDEN}->{CLASSES}, mean, Adam",
                 optimized=args.optimize, rounds=args.rounds, warmup_steps=args.warmup, timed_steps_per_rank=args.steps,
                 threads_per_rank=1, backend="gloo (init_process_group(backend=None))", launch="subprocesses on "
                 "localhost with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (what torchrun sets)",
                 graph="R-MAT a=0.57 b=0.19 c=0.19 seed 0 (bench/gnn_sampling.power_law_csc), every node a seed",
                 cpus=os.cpu_count())
    rep.meta["threads"] = 1  # per rank (the Report's default reads this process's thread count)
    rep.meta["load_avg_at_start"] = _loadavg()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="cpu_opt_gnn_dist_") as tmp:
        tmp = Path(tmp)
        graph = tmp / "graph.pt"
        rep.meta.update(build_graph(n, e, graph))
        rep.meta["graph_build_s"] = round(time.time() - t0, 1)
        runs = {w: [] for w in procs}
        for rnd in range(args.rounds):  # the world sizes alternate, so a change in load hits both
            for w in procs:
                before = _loadavg()
                print(f"gnn_distributed: round {rnd}, {w} process(es), load average {before}", flush=True)
                res = run_world(w, graph, tmp, args)
                runs[w].append({"step_s": max(r["seconds"] for r in res) / args.steps,
                                "sample_s": max(r["sample_seconds"] for r in res) / args.steps,
                                "allreduce_ms": max(r["allreduce_ms"] for r in res), "res": res,
                                "load_avg_before": before, "load_avg_after": _loadavg()})
        base = None
        for w in procs:
            rs = sorted(runs[w], key=lambda r: r["step_s"])
            med = rs[(len(rs) - 1) // 2]  # the lower median
            res, step_s = med["res"], med["step_s"]
            epoch_steps = res[0]["epoch_steps"]
            row = rep.add(procs=w, ms_per_step=step_s * 1e3, sample_ms_per_step=med["sample_s"] * 1e3,
                          epoch_steps_per_rank=epoch_steps, projected_epoch_s=step_s * epoch_steps,
                          seeds_per_s=w * args.batch / step_s, allreduce_ms=med["allreduce_ms"],
                          grad_numel=res[0]["grad_numel"], sampled_nodes_per_step=res[0]["nodes_per_step"],
                          loss=res[0]["loss"], runs_ms_per_step=[round(r["step_s"] * 1e3, 1) for r in runs[w]],
                          load_avg_before=[r["load_avg_before"] for r in runs[w]],
                          load_avg_after=[r["load_avg_after"] for r in runs[w]])
            base = base or row
            one = base["procs"] == 1
            row["speedup_vs_1proc"] = base["projected_epoch_s"] / row["projected_epoch_s"] if one else None
    rep.meta["wall_s"] = round(time.time() - t0, 1)
    rep.meta["load_avg_at_end"] = _loadavg()
    rep.print_table(["procs", "ms_per_step", "sample_ms_per_step", "epoch_steps_per_rank", "projected_epoch_s",
                     "seeds_per_s", "speedup_vs_1proc", "allreduce_ms", "runs_ms_per_step"])
    rep.save(RESULTS_DIR / f"{rep.name}_{machine_slug()}.json")  # one file per CPU
    return rep


# ----------------------------------------------------------------------------- one rank

def _worker(argv) -> int:
    graph, out, warmup, steps, fanouts, batch, optimize = argv
    warmup, steps, batch = int(warmup), int(steps), int(batch)
    fanouts = [int(f) for f in fanouts.split(",")]
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, chain=True)  # a rank stopped from outside says where it was
    faulthandler.register(signal.SIGUSR1)
    torch.set_num_threads(1)
    t_start = time.perf_counter()

    def log(msg):
        stamp = f"[rank {os.environ.get('RANK')} {time.perf_counter() - t_start:6.1f} s]"
        print(f"{stamp} {msg}", file=sys.stderr, flush=True)

    from torch_geometric.data import Data
    from torch_geometric.nn import GraphSAGE

    from cpu_opt import gnn
    from cpu_opt.gnn import distributed as gd

    info = gd.init(timeout=600)
    log(f"process group of {info.world_size} formed")
    d = torch.load(graph, mmap=True)
    data = Data(x=d["x"], y=d["y"], edge_index=d["edge_index"], num_nodes=d["x"].shape[0])
    loader = gd.DistributedNeighborLoader(data, fanouts, batch_size=batch, seed=0, is_sorted=True)
    torch.manual_seed(0)
    net = GraphSAGE(FEATURES, HIDDEN, len(fanouts), out_channels=CLASSES)
    model = gd.wrap(gnn.optimize(net) if optimize == "1" else net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    log(f"loader and model ready; {len(loader)} steps per epoch")
    gd.train_epoch(model, loader, opt, max_steps=warmup)
    log(f"{warmup} warm-up steps done")
    loader.set_epoch(1)
    nodes = []

    def loss_fn(m, b):
        nodes.append(b.num_nodes)
        return gd.node_classification_loss(m, b)

    st = gd.train_epoch(model, loader, opt, loss_fn=loss_fn, max_steps=steps)
    log(f"{steps} timed steps: {st.seconds / steps * 1e3:.0f} ms per step")
    grad = torch.zeros(sum(q.numel() for q in net.parameters()))
    torch.distributed.all_reduce(grad)  # warm-up
    t0 = time.perf_counter()
    for _ in range(20):
        torch.distributed.all_reduce(grad)
    ar_ms = (time.perf_counter() - t0) / 20 * 1e3
    Path(out).write_text(json.dumps({"rank": info.rank, "seconds": st.seconds, "sample_seconds": st.sample_seconds,
                                     "epoch_steps": len(loader), "loss": st.loss, "allreduce_ms": ar_ms,
                                     "grad_numel": grad.numel(), "nodes_per_step": sum(nodes) / len(nodes)}))
    gd.cleanup()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker(sys.argv[2:]))
    main(argv=sys.argv[1:])
