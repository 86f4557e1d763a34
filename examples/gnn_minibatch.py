"""Mini-batch GraphSAGE training with PyG's NeighborLoader on cpu_opt's neighbour sampler, with
neither pyg-lib nor torch-sparse installed.

    python examples/gnn_minibatch.py                      # 20k-node R-MAT graph, 2 workers
    python examples/gnn_minibatch.py --nodes 200000 --edges 2000000 --workers 0

``cpu_opt.gnn.install_sampler()`` gives PyG the sampling operator it looks for (see
gnn/sampling.py); PyG's own NeighborLoader then samples [15, 10] neighbours per seed. The script
trains a few epochs and exits non-zero unless the training accuracy ends clearly above chance
and the loss went down.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GraphSAGE

from cpu_opt import gnn
from cpu_opt.gnn.rmat import node_task, rmat_edge_index


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--edges", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    args = p.parse_args(argv)

    if not gnn.install_sampler():
        print("pyg-lib is installed: PyG samples with it (cpu_opt's hook not needed)")
    torch.manual_seed(0)
    classes = 4
    edge_index = rmat_edge_index(args.nodes, args.edges, seed=0)
    x, y = node_task(args.nodes, 32, classes, edge_index, seed=0)
    data = Data(x=x, y=y, edge_index=edge_index, num_nodes=args.nodes)
    loader = NeighborLoader(data, num_neighbors=[15, 10], batch_size=args.batch_size, shuffle=True,
                            num_workers=args.workers, persistent_workers=args.workers > 0)
    model = GraphSAGE(32, 64, 2, out_channels=classes)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    first_loss = last_loss = acc = None
    for epoch in range(args.epochs):
        t0, total, correct, seen, n_sampled = time.perf_counter(), 0.0, 0, 0, 0
        for batch in loader:
            opt.zero_grad()
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            target = batch.y[:batch.batch_size]
            loss = F.cross_entropy(out, target)
            loss.backward()
            opt.step()
            total += loss.item() * batch.batch_size
            correct += int((out.argmax(1) == target).sum())
            seen += batch.batch_size
            n_sampled += batch.num_nodes
        last_loss, acc = total / seen, correct / seen
        first_loss = last_loss if first_loss is None else first_loss
        print(f"epoch {epoch}: loss {last_loss:.4f}  train acc {acc:.3f}  {time.perf_counter() - t0:.2f} s  "
              f"({n_sampled / seen:.0f} sampled nodes per seed)")
    ok = acc > 1.5 / classes and last_loss < first_loss
    print("OK" if ok else f"FAILED: accuracy {acc:.3f} (chance {1 / classes:.2f}), loss {first_loss:.4f} -> {last_loss:.4f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
