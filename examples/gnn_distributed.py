"""Mini-batch GraphSAGE on several processes: torch.distributed (gloo) + DistributedDataParallel,
each rank sampling its share of the seed nodes with cpu_opt's neighbour sampler.

One machine, two processes (tested here, with the venv's torchrun):

    torchrun --nproc-per-node=2 examples/gnn_distributed.py
    torchrun --nproc-per-node=2 examples/gnn_distributed.py --nodes 200000 --edges 2000000 --epochs 2

``python examples/gnn_distributed.py`` runs the same script as a world of one process.

Several machines (NOT tested here: this VM is one machine). Start the same command on every
machine; each runs ``--nproc-per-node`` ranks, and all of them meet at a rendezvous endpoint, a
``host:port`` on one of the machines that all of them can reach:

    # on every machine, with the node count and the endpoint the same everywhere
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node0.example:29400 \\
        --rdzv-id=gnn-job-1 examples/gnn_distributed.py

    # or with a fixed rank per machine and a static master instead of the c10d rendezvous
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=4 --master-addr=node0.example --master-port=29500 \\
        examples/gnn_distributed.py        # on node0; on node1 the same with --node-rank=1

Notes for a cluster: the port must be open between the machines; gloo picks the network interface
from the host name, ``GLOO_SOCKET_IFNAME=eth0`` forces one; set ``OMP_NUM_THREADS`` to the cores
per rank (torchrun sets 1 when it starts several ranks per machine); every rank here builds the
same seeded graph itself, where a real job would load it (or its partition) from shared storage.
``--timeout`` bounds how long a rank waits for the others (at the start, and in every gradient
all-reduce): a rank that dies or hangs makes the others stop with ``RankFailureError`` after at
most that long (torchrun also stops the other ranks of a job when one exits with an error).

The script trains a few epochs and exits non-zero on every rank unless the loss went down and all
ranks hold the same parameters at the end.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch_geometric.data import Data
from torch_geometric.nn import GraphSAGE

from cpu_opt.gnn import distributed as gd
from cpu_opt.gnn.rmat import node_task, rmat_edge_index


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--edges", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=512, help="seed nodes per rank per step")
    p.add_argument("--fanouts", default="10,5")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits for the others")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: OMP_NUM_THREADS, else torch's default)")
    args = p.parse_args(argv)

    info = gd.init(timeout=args.timeout)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log = print if info.rank == 0 else (lambda *a, **k: None)
    log(f"world of {info.world_size} process(es), backend {info.backend}, timeout {info.timeout_s:g} s, "
        f"{torch.get_num_threads()} thread(s) per rank")

    classes = 4
    edge_index = rmat_edge_index(args.nodes, args.edges, seed=0)  # the same seeded graph on every rank
    x, y = node_task(args.nodes, 32, classes, edge_index, seed=0)
    data = Data(x=x, y=y, edge_index=edge_index, num_nodes=args.nodes)
    fanouts = [int(f) for f in args.fanouts.split(",")]
    loader = gd.DistributedNeighborLoader(data, fanouts, batch_size=args.batch_size, seed=0)
    torch.manual_seed(0)
    model = gd.wrap(GraphSAGE(32, 64, len(fanouts), out_channels=classes))  # rank 0's init is broadcast
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    log(f"{loader.num_seeds} seed nodes per rank per epoch, {len(loader)} steps of {args.batch_size}")

    losses = []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        st = gd.train_epoch(model, loader, opt)
        losses.append(st.loss)
        log(f"epoch {epoch}: loss {st.loss:.4f} (rank 0's own {st.local_loss:.4f})  {time.perf_counter() - t0:.2f} s, "
            f"of which {st.sample_seconds:.2f} s waiting for batches")

    # every rank compares its parameters with rank 0's
    flat = torch.cat([q.detach().reshape(-1) for q in model.module.parameters()])
    ref = flat.clone()
    torch.distributed.broadcast(ref, src=0)
    diff = torch.tensor([float((flat - ref).abs().max())])
    torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
    agree = float(diff) <= 1e-6
    went_down = len(losses) >= 2 and losses[-1] < losses[0]
    ok = agree and went_down
    log(f"parameters: max difference between ranks {float(diff):.2e}; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    log("OK" if ok else "FAILED: " + ("ranks disagree on the parameters; " if not agree else "")
        + ("the loss did not go down" if not went_down else ""))
    gd.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
