"""cpu_opt.gnn.distributed: mini-batch GraphSAGE on N processes with gloo and DDP.

* split_seeds gives equal, disjoint, deterministic shards; DistributedNeighborLoader samples each
  batch on its own stream seeded by (seed, rank, epoch, step), the same with DataLoader workers
  and whatever the model draws from torch's generator in between;
* 2 processes on localhost (subprocesses of this file, 1 thread each) reach the parameters of one
  process that steps on the union of both ranks' batches with the loss 0.5 * (loss_0 + loss_1),
  rebuilt here from the same per-rank loaders; ranks with different step counts get a clear error;
* a rank that dies (os._exit) or hangs in the middle of an epoch makes rank 0 raise
  RankFailureError naming its rank and the timeout, quickly (dead: its connection closes) or
  within the timeout (hung), instead of hanging.
"""
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_geometric")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from cpu_opt.gnn import distributed as gd  # noqa: E402

FANOUTS, BATCH, STEPS, EPOCHS, LR = [5, 3], 64, 3, 2, 0.5
FAIL_TIMEOUT_S = 6.0       # the process-group timeout of the failure runs
WORKER_TIMEOUT_S = 60.0    # a whole subprocess run; beyond it the test fails as "hung"


def _data():
    from torch_geometric.data import Data

    from cpu_opt.gnn.rmat import node_task, rmat_edge_index

    n = 3000
    ei = rmat_edge_index(n, 30_000, seed=0)
    x, y = node_task(n, 16, 4, ei, seed=0)
    return Data(x=x, y=y, edge_index=ei, num_nodes=n)


def _model():
    from torch_geometric.nn import GraphSAGE

    torch.manual_seed(0)
    return GraphSAGE(16, 32, 2, out_channels=4)


def _loader(data, rank=None, world_size=None, **kw):
    return gd.DistributedNeighborLoader(data, FANOUTS, batch_size=BATCH, seed=7, rank=rank, world_size=world_size,
                                        **kw)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- in-process

def test_split_seeds_equal_disjoint_deterministic():
    seeds = torch.randperm(1003, generator=torch.Generator().manual_seed(0)) + 5
    for world in (1, 2, 3, 4):
        shards = [gd.split_seeds(seeds, r, world, epoch=1, seed=3) for r in range(world)]
        assert {s.numel() for s in shards} == {1003 // world}
        allk = torch.cat(shards)
        assert allk.unique().numel() == allk.numel()                      # disjoint
        assert bool(torch.isin(allk, seeds).all())
        assert all(torch.equal(s, gd.split_seeds(seeds, r, world, epoch=1, seed=3)) for r, s in enumerate(shards))
    a, b = gd.split_seeds(seeds, 0, 2, epoch=0), gd.split_seeds(seeds, 0, 2, epoch=1)
    assert not torch.equal(a, b)                                              # reshuffled per epoch
    pad = [gd.split_seeds(seeds, r, 4, remainder="pad") for r in range(4)]
    assert {s.numel() for s in pad} == {251} and torch.cat(pad).unique().numel() == 1003  # all kept, 1 repeated
    assert torch.equal(gd.split_seeds(torch.arange(6), 1, 2, shuffle=False), torch.tensor([1, 3, 5]))
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[2, 5, 7, 9]] = True
    assert sorted(torch.cat([gd.split_seeds(mask, r, 2) for r in range(2)]).tolist()) == [2, 5, 7, 9]


def test_split_seeds_errors():
    with pytest.raises(ValueError, match="every rank needs at least one"):
        gd.split_seeds(torch.arange(3), 0, 4)
    with pytest.raises(ValueError, match="out of range"):
        gd.split_seeds(torch.arange(10), 2, 2)
    with pytest.raises(ValueError, match="remainder"):
        gd.split_seeds(torch.arange(10), 0, 2, remainder="wrap")
    with pytest.raises(TypeError, match="integer node ids"):
        gd.split_seeds(torch.rand(10), 0, 2)
    with pytest.raises(ValueError, match="no process group"):
        gd.split_seeds(torch.arange(10))


def _batches(loader, n=3):
    return [(b.n_id.clone(), b.edge_index.clone(), b.batch_size) for b in itertools.islice(loader, n)]


def test_loader_reproducible_per_rank_epoch_and_step():
    data = _data()
    l0, l1 = _loader(data, 0, 2), _loader(data, 1, 2)
    assert len(l0) == len(l1) == -(-(3000 // 2) // BATCH) and l0.num_seeds == 1500
    first = _batches(l0)
    torch.rand(1000)                                                    # the model's draws do not matter
    again = []
    for b in itertools.islice(l0, 3):
        torch.nn.functional.dropout(torch.ones(100), 0.5)
        again.append((b.n_id.clone(), b.edge_index.clone(), b.batch_size))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    other = _batches(l1)
    assert not set(first[0][0][:BATCH].tolist()) & set(other[0][0][:BATCH].tolist())  # ranks' seeds disjoint
    l0.set_epoch(1)
    assert not torch.equal(_batches(l0, 1)[0][0], first[0][0])
    # the same sample for the same seeds at another step: the stream depends on the step
    nos = _loader(data, 0, 1, shuffle=False)
    b0 = _batches(nos, 1)[0]
    nos.set_epoch(1)
    assert torch.equal(_batches(nos, 1)[0][0][:BATCH], b0[0][:BATCH]) and not torch.equal(_batches(nos, 1)[0][0], b0[0])
    # every batch has BATCH seeds except a last one of the same size on every rank
    sizes = [b.batch_size for b in l0]
    assert sizes == [b.batch_size for b in l1] and sizes[:-1] == [BATCH] * (len(sizes) - 1)


def test_loader_workers_sample_the_same():
    data = _data()
    want = _batches(_loader(data, 1, 2), 5)
    got = _batches(_loader(data, 1, 2, num_workers=2), 5)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got))
    with pytest.raises(ValueError, match="persistent_workers"):
        _loader(data, 0, 2, num_workers=1, persistent_workers=True)
    with pytest.raises(TypeError, match="'sampler' is not accepted"):
        _loader(data, 0, 2, sampler=range(3))


def test_init_single_process_picks_gloo(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="positive number of seconds"):
        gd.init(timeout=0)
    info = gd.init(timeout=30)
    try:
        assert info == gd.DistInfo(0, 1, 0, "gloo", 30.0)
        data = _data()
        model, ref = gd.wrap(_model()), _model()
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
        loader = _loader(data)
        stats = gd.train_epoch(model, loader, opt, max_steps=2)
        assert stats.steps == 2 and stats.seeds == 2 * BATCH and stats.loss == pytest.approx(stats.local_loss)
        for b in itertools.islice(_loader(data, 0, 1), 2):                  # world of 1 == plain training
            ref_opt.zero_grad()
            gd.node_classification_loss(ref, b).backward()
            ref_opt.step()
        for k, v in _params(ref).items():
            torch.testing.assert_close(model.module.state_dict()[k], v, atol=1e-6, rtol=1e-5)
    finally:
        gd.cleanup()
    with pytest.raises(RuntimeError, match="call cpu_opt.gnn.distributed.init"):
        gd.train_epoch(model, loader, opt)


# ----------------------------------------------------------------------------- 2 processes

def _launch(mode: str, out: Path, world: int = 2):
    port = gd.free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, mode, str(out)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _wait(proc, deadline):
    try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return None, out


def test_two_processes_match_one_process_on_the_global_batches(tmp_path):
    t0 = time.monotonic()
    procs = _launch("equal", tmp_path)
    results = [_wait(p, t0 + WORKER_TIMEOUT_S) for p in procs]
    for r, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {r} exited with {rc} (None: still running after {WORKER_TIMEOUT_S} s):\n{out}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for k in ranks[0]["params"]:                                          # DDP keeps the replicas equal
        torch.testing.assert_close(ranks[1]["params"][k], ranks[0]["params"][k], atol=1e-6, rtol=0)

    # the reference: one process, both ranks' batches each step, loss averaged the way DDP averages gradients
    data = _data()
    model, alone = _model(), _model()
    init = _params(model)
    opt, opt_alone = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(alone.parameters(), lr=LR)
    loaders = [_loader(data, r, 2) for r in range(2)]
    losses = []
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for epoch in range(EPOCHS):
            for ld in loaders:
                ld.set_epoch(epoch)
            for b0, b1 in itertools.islice(zip(*loaders), STEPS):
                opt.zero_grad()
                parts = [gd.node_classification_loss(model, b) for b in (b0, b1)]
                (0.5 * (parts[0] + parts[1])).backward()
                opt.step()
                losses.append(0.5 * (parts[0].item() + parts[1].item()))
                opt_alone.zero_grad()                                     # rank 0's batches only
                gd.node_classification_loss(alone, b0).backward()
                opt_alone.step()
    finally:
        torch.set_num_threads(old)
    want, solo = _params(model), _params(alone)
    moved = max(float((want[k] - init[k]).abs().max()) for k in want)
    apart = max(float((want[k] - solo[k]).abs().max()) for k in want)
    assert moved > 1e-2 and apart > 1e-3, (moved, apart)                  # the comparison can tell them apart
    for r in range(2):
        for k, v in want.items():
            torch.testing.assert_close(ranks[r]["params"][k], v, atol=1e-5, rtol=1e-5, msg=f"rank {r}, {k}")
        # train_epoch's loss: the mean over steps of the rank-averaged loss
        for e in range(EPOCHS):
            assert ranks[r]["loss"][e] == pytest.approx(sum(losses[e * STEPS:(e + 1) * STEPS]) / STEPS, rel=1e-5)
    # ranks that disagree on the number of steps get a clear error instead of a deadlock
    for r in range(2):
        assert "different numbers of steps" in ranks[r]["uneven"], ranks[r]["uneven"]


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_failed_rank_makes_the_others_raise_within_the_timeout(tmp_path, how):
    t0 = time.monotonic()
    procs = _launch(how, tmp_path)
    rc0, out0 = _wait(procs[0], t0 + WORKER_TIMEOUT_S)
    if how == "hang":
        procs[1].kill()                                                     # it sleeps: end it
    rc1, out1 = _wait(procs[1], time.monotonic() + 10)
    assert rc0 is not None, f"rank 0 still running after {WORKER_TIMEOUT_S} s: it hung\n{out0}"
    assert rc0 == 3, f"rank 0 exited with {rc0}, expected 3 (RankFailureError):\n{out0}\n--- rank 1:\n{out1}"
    if how == "die":
        assert rc1 == 17, out1
    line = next(ln for ln in out0.splitlines() if ln.startswith("RANK_FAILURE "))
    res = json.loads(line[len("RANK_FAILURE "):])
    msg = res["message"]
    assert res["type"] == "RankFailureError" and isinstance(res["is_runtime_error"], bool) and res["is_runtime_error"]
    assert msg.startswith("rank 0 of 2: a collective failed at step 1 of 3"), msg
    assert "Another rank has probably died, hung or left the job" in msg and f"{FAIL_TIMEOUT_S:g} s" in msg, msg
    if how == "die":
        assert res["seconds"] < FAIL_TIMEOUT_S, res                         # a closed connection: no waiting
    else:
        assert 0.8 * FAIL_TIMEOUT_S <= res["seconds"] <= FAIL_TIMEOUT_S + 5, res
        assert "timed out" in msg.lower(), msg


# ----------------------------------------------------------------------------- the worker processes

def _worker(mode: str, out: Path) -> int:
    torch.set_num_threads(1)
    info = gd.init(timeout=FAIL_TIMEOUT_S if mode in ("die", "hang") else 60)
    data = _data()
    model = gd.wrap(_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = _loader(data)
    if mode == "equal":
        losses = []
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            losses.append(gd.train_epoch(model, loader, opt, max_steps=STEPS).loss)
        res = {"params": _params(model.module), "loss": losses}
        try:
            gd.train_epoch(model, loader, opt, max_steps=STEPS + info.rank)
            res["uneven"] = "no error"
        except ValueError as e:
            res["uneven"] = str(e)
        torch.save(res, out / f"rank{info.rank}.pt")
        gd.cleanup()
        return 0
    calls = []

    def loss_fn(m, batch):  # rank 1 dies / hangs at its second step, after one good all-reduce
        calls.append(1)
        if info.rank == 1 and len(calls) == 2:
            if mode == "die":
                os._exit(17)
            time.sleep(300)
        return gd.node_classification_loss(m, batch)

    t0 = time.monotonic()
    try:
        gd.train_epoch(model, loader, opt, loss_fn=loss_fn, max_steps=STEPS)
    except gd.RankFailureError as e:
        t = time.monotonic() - t0
        print("RANK_FAILURE " + json.dumps({"type": type(e).__name__, "is_runtime_error": isinstance(e, RuntimeError),
                                            "seconds": t, "message": str(e)}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], Path(sys.argv[2])))
