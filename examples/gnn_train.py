"""Full-batch GraphSAGE and GCN training on CPU with cpu_opt.gnn, checked against PyG's default path.

    python examples/gnn_train.py                 # R-MAT power-law graph (20k nodes, 200k edges) + KarateClub
    python examples/gnn_train.py --nodes 100000 --edges 1000000 --epochs 20

For each model, the same initial weights are trained twice: by PyG 2.8's default ``edge_index``
path and by ``cpu_opt.gnn.optimize(model)``. The script prints both loss curves and epoch times
and exits non-zero if the curves differ by more than float tolerance.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from torch_geometric.nn import GCNConv, SAGEConv

from cpu_opt import gnn
from cpu_opt.gnn.rmat import node_task, rmat_edge_index


class Net(torch.nn.Module):
    def __init__(self, conv, f_in, hidden, classes, dropout=0.5):
        super().__init__()
        self.c1, self.c2 = conv(f_in, hidden), conv(hidden, classes)
        self.dropout = dropout

    def forward(self, x, edge_index):
        h = self.c1(x, edge_index).relu()
        h = torch.nn.functional.dropout(h, self.dropout, self.training)
        return self.c2(h, edge_index)


def train(model, params, x, edge_index, y, epochs, lr=0.01, seed=0):
    opt = torch.optim.Adam(params, lr=lr)
    losses, times = [], []
    torch.manual_seed(seed)  # the same dropout masks for both paths
    for _ in range(epochs):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x, edge_index), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def compare(name, make, x, edge_index, y, epochs) -> bool:
    torch.manual_seed(0)
    ref = make()
    fast_model = copy.deepcopy(ref)
    fast = gnn.optimize(fast_model)
    l_ref, t_ref = train(ref, ref.parameters(), x, edge_index, y, epochs)
    l_fast, t_fast = train(fast, fast_model.parameters(), x, edge_index, y, epochs)
    ok = torch.allclose(torch.tensor(l_fast), torch.tensor(l_ref), rtol=1e-4, atol=1e-5)
    med = lambda t: sorted(t[1:])[len(t[1:]) // 2] if len(t) > 1 else t[0]  # noqa: E731  (skip epoch 1: graph conversion)
    print(f"{name}: loss PyG {l_ref[0]:.4f} -> {l_ref[-1]:.4f}, cpu_opt {l_fast[0]:.4f} -> {l_fast[-1]:.4f}, "
          f"max |diff| {max(abs(a - b) for a, b in zip(l_ref, l_fast)):.2e} {'OK' if ok else 'MISMATCH'}; "
          f"median epoch PyG {med(t_ref) * 1e3:.1f} ms, cpu_opt {med(t_fast) * 1e3:.1f} ms "
          f"({med(t_ref) / med(t_fast):.2f}x), first cpu_opt epoch {t_fast[0] * 1e3:.1f} ms")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--edges", type=int, default=200_000)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--epochs", type=int, default=10)
    args = p.parse_args(argv)
    print(f"threads={torch.get_num_threads()}")
    ok = True

    ei = rmat_edge_index(args.nodes, args.edges, seed=0)
    x, y = node_task(args.nodes, args.features, args.classes, ei, seed=0)
    print(f"R-MAT graph: {args.nodes} nodes, {args.edges} edges, {args.features} features")
    f, c = args.features, args.classes
    ok &= compare("GraphSAGE-mean", lambda: Net(lambda i, o: SAGEConv(i, o, aggr="mean"), f, 64, c), x, ei, y, args.epochs)
    ok &= compare("GCN", lambda: Net(GCNConv, f, 64, c), x, ei, y, args.epochs)

    from torch_geometric.datasets import KarateClub

    data = KarateClub()[0]
    print(f"KarateClub: {data.num_nodes} nodes, {data.num_edges} edges")
    kf, kc = data.num_features, int(data.y.max()) + 1
    ok &= compare("GraphSAGE-mean", lambda: Net(lambda i, o: SAGEConv(i, o, aggr="mean"), kf, 16, kc),
                  data.x, data.edge_index, data.y, 50)
    ok &= compare("GCN", lambda: Net(GCNConv, kf, 16, kc), data.x, data.edge_index, data.y, 50)
    print("all loss curves equal within float tolerance" if ok else "LOSS CURVES DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
