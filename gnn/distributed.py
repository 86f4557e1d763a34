"""Mini-batch GNN training on N processes with ``torch.distributed`` (gloo on CPU) and DDP.

Each rank samples its own share of the seed nodes with cpu_opt's neighbour sampler (PyG's
``NeighborLoader`` through :func:`cpu_opt.gnn.install_sampler`), runs forward and backward on its
subgraphs, and ``DistributedDataParallel`` all-reduces (averages) the gradients, so every rank
takes the same optimizer step::

    from cpu_opt.gnn import distributed as gd
    info = gd.init(timeout=120)                        # reads torchrun's RANK / WORLD_SIZE / MASTER_*
    loader = gd.DistributedNeighborLoader(data, [10, 5], batch_size=1024, seed=0)
    model = gd.wrap(GraphSAGE(...))                    # DistributedDataParallel on CPU
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for epoch in range(10):
        loader.set_epoch(epoch)
        stats = gd.train_epoch(model, loader, opt)     # stats.loss: averaged over all ranks
    gd.cleanup()

Run with ``torchrun --nproc-per-node=2 script.py`` (examples/gnn_distributed.py shows the flags
for several machines).

What each piece guarantees:

* :func:`init` calls ``init_process_group`` without naming a backend (``backend=None``; torch
  2.13 then picks gloo on a machine without an accelerator: ``Backend.default_device_backend_map
  ['cpu']``) and with a finite ``timeout`` (default 300 s; torch's own default is 30 minutes).
  Every collective -- DDP's gradient all-reduce included -- fails once a peer has not answered
  for that long.
* :func:`split_seeds`: every rank gets the same number of seeds (DDP needs every rank to run the
  same number of steps: a rank with one step more waits forever in its all-reduce). The seeds are
  permuted with a generator seeded by ``(seed, epoch)`` -- the same on every rank, no
  communication -- and rank ``r`` takes positions ``r, r + W, r + 2W, ...``.
  ``remainder="drop"`` (default) leaves out the last ``len(seeds) % W`` seeds of the permutation
  (different ones each epoch, so none is left out for good); ``remainder="pad"`` repeats the
  first ones instead, as torch's ``DistributedSampler`` does.
* :class:`DistributedNeighborLoader` samples each batch with its own random stream, seeded by
  ``(seed, rank, epoch, step)``: the same call gives the same subgraphs whatever the model does
  with torch's random generator in between (dropout), and one process can rebuild exactly what
  rank r sampled (the tests do). Per-rank batches have equal sizes, the last one included.
* :func:`train_epoch` checks first that every rank has the same number of steps (one small
  all-reduce; raises instead of deadlocking), and turns a failed collective -- a peer that died
  (gloo sees the connection close: immediate) or hangs (the timeout) -- into a
  :class:`RankFailureError` naming this rank, the step and the timeout.

The loss DDP optimises is the mean over ranks of each rank's mean loss: with equal per-rank batch
sizes, the mean over the global batch.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import time
from typing import Callable, NamedTuple, Optional

import torch

from .sampling import install_sampler

__all__ = ["DEFAULT_TIMEOUT_S", "DistInfo", "DistributedNeighborLoader", "EpochStats", "RankFailureError",
           "cleanup", "init", "node_classification_loss", "split_seeds", "train_epoch", "wrap"]

DEFAULT_TIMEOUT_S = 300.0
_timeout_s: Optional[float] = None  # the timeout init() set, for error messages


class RankFailureError(RuntimeError):
    """A collective failed: another rank died, hung, or left the job (raised on the survivors)."""


class DistInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    backend: str          # the backend the CPU collectives run on ("gloo")
    timeout_s: float


# ----------------------------------------------------------------------------- process group

def _seconds(timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds (or a timedelta), got {timeout!r}")
    return float(timeout)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_backend() -> str:
    """The backend the default process group runs CPU collectives on (``get_backend()`` says
    ``"undefined"`` when the group was created without naming one)."""
    import torch.distributed as dist

    cfg = str(dist.get_backend_config())  # e.g. "cpu:gloo"
    for part in cfg.split(","):
        dev, _, name = part.partition(":")
        if dev.strip() == "cpu" and name:
            return name.strip()
    return dist.get_backend()


def init(backend: Optional[str] = None, *, timeout=DEFAULT_TIMEOUT_S, init_method: Optional[str] = None,
         rank: Optional[int] = None, world_size: Optional[int] = None) -> DistInfo:
    """Create the default process group (or return the one that exists) and return this rank's
    :class:`DistInfo`.

    ``backend=None`` lets torch choose (gloo on CPU). ``timeout`` (seconds or a timedelta) bounds
    every collective and the rendezvous: it has to exceed the longest time one rank may run
    ahead of another (graph loading before the first step, a long evaluation on rank 0 alone).
    Rank and world size come from the arguments, else from the environment torchrun sets
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); with neither, a world of one
    process on a free localhost port, so the same script also runs under plain ``python``.
    """
    global _timeout_s
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    secs = _seconds(timeout)
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                        cpu_backend(), _timeout_s if _timeout_s is not None else float("nan"))
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    rank = int(env_rank) if rank is None and env_rank is not None else rank
    world_size = int(env_world) if world_size is None and env_world is not None else world_size
    if init_method is None and rank is None and world_size is None:  # plain `python script.py`
        rank, world_size = 0, 1
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    if rank is None or world_size is None:
        raise ValueError(f"init: rank ({rank}) and world_size ({world_size}) must both be known: pass them, or "
                         "launch with torchrun (which sets RANK and WORLD_SIZE)")
    if not 0 <= rank < world_size:
        raise ValueError(f"init: rank {rank} is out of range for world_size {world_size}")
    if init_method is None and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        raise ValueError("init: MASTER_ADDR and MASTER_PORT must be set (torchrun sets them) or init_method given "
                         "(e.g. 'tcp://host:port')")
    try:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=secs))
    except Exception as e:
        raise RankFailureError(f"rank {rank} of {world_size}: the process group could not be formed within "
                               f"{secs:g} s (rendezvous at {init_method or _master()}): {e}") from e
    _timeout_s = secs
    return DistInfo(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)), cpu_backend(), secs)


def _master() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def cleanup() -> None:
    """Destroy the default process group (a no-op when there is none). Call it at the end, after
    the last collective.

    It first sleeps 0.2 s: gloo's worker thread frees each finished collective after the caller
    has moved on, and freeing it can need the GIL. If the last reference to the process group
    (the DDP model's, once the group is destroyed) goes away while that is still pending, the
    group's destructor joins the worker thread while holding the GIL and the process hangs for
    good (seen here at the end of the 1M-node benchmark: main thread in ``~ProcessGroupGloo`` ->
    ``thread::join``, gloo's ``runLoop`` in ``~AsyncAllreduceWork`` -> ``take_gil``). Sleeping
    hands the GIL over so the pending frees finish first."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        time.sleep(0.2)
        dist.destroy_process_group()


def _rank_world(rank, world_size):
    if rank is None or world_size is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("rank and world_size are needed when no process group is initialized "
                             "(call cpu_opt.gnn.distributed.init() first, or pass them)")
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    return rank, world_size


def wrap(model: torch.nn.Module, **ddp_kwargs) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(model)`` for CPU training (no ``device_ids``). DDP broadcasts
    rank 0's parameters and buffers, so every rank starts from the same model. A failed
    broadcast raises :class:`RankFailureError`."""
    try:
        return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    except Exception as e:
        if _is_comm_error(e):
            raise _rank_failure(e, "while wrapping the model in DistributedDataParallel (broadcast of rank 0's "
                                   "parameters)") from e
        raise


# ----------------------------------------------------------------------------- seeds

def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): distinct inputs give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        h = (h + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def _shard_positions(n: int, rank: int, world_size: int, *, epoch: int, seed: int, shuffle: bool,
                     remainder: str) -> torch.Tensor:
    if remainder not in ("drop", "pad"):
        raise ValueError(f"remainder must be 'drop' or 'pad', got {remainder!r}")
    if n < world_size and remainder == "drop" or n == 0:
        raise ValueError(f"{n} seed nodes cannot be split over {world_size} ranks with remainder={remainder!r}: "
                         "every rank needs at least one")
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(_mix(seed, epoch)))
    else:
        order = torch.arange(n)
    per_rank = n // world_size if remainder == "drop" else -(-n // world_size)
    total = per_rank * world_size
    if total > n:  # pad: repeat from the start (as DistributedSampler does), cycling if n is tiny
        order = order.repeat(-(-total // n))
    return order[:total][rank::world_size]


def split_seeds(seeds, rank: Optional[int] = None, world_size: Optional[int] = None, *, epoch: int = 0,
                seed: int = 0, shuffle: bool = True, remainder: str = "drop") -> torch.Tensor:
    """This rank's share of ``seeds`` (1-D node ids, or a bool mask over the nodes): a
    permutation seeded by ``(seed, epoch)`` -- identical on every rank -- of which rank ``r``
    takes every ``world_size``-th element starting at ``r``. Every rank gets
    ``len(seeds) // world_size`` seeds with ``remainder="drop"`` (the permutation's last
    ``len(seeds) % world_size`` are left out this epoch), or ``ceil(len / world_size)`` with
    ``"pad"`` (the first ones repeated). The shards of one epoch are disjoint with "drop" and
    together cover the kept seeds. ``rank``/``world_size`` default to the process group's."""
    rank, world_size = _rank_world(rank, world_size)
    seeds = _seed_tensor(seeds)
    return seeds[_shard_positions(seeds.numel(), rank, world_size, epoch=epoch, seed=seed, shuffle=shuffle,
                                  remainder=remainder)]


def _seed_tensor(seeds) -> torch.Tensor:
    if not isinstance(seeds, torch.Tensor):
        raise TypeError(f"seeds must be a tensor of node ids or a bool mask, got {type(seeds).__name__}")
    if seeds.dim() != 1:
        raise ValueError(f"seeds must be 1-D, got shape {tuple(seeds.shape)}")
    if seeds.dtype == torch.bool:
        return seeds.nonzero().view(-1)
    if seeds.dtype.is_floating_point or seeds.is_complex():
        raise TypeError(f"seeds must hold integer node ids (or be a bool mask), got {seeds.dtype}")
    return seeds.to(torch.int64)


# ----------------------------------------------------------------------------- the loader

class _ShardSampler(torch.utils.data.Sampler):
    """Positions (into the loader's input nodes) of one rank's shard for the current epoch."""

    def __init__(self, n, rank, world_size, seed, shuffle, remainder):
        self.n, self.rank, self.world_size = n, rank, world_size
        self.seed, self.shuffle, self.remainder, self.epoch = seed, shuffle, remainder, 0
        self._len = len(self._positions())

    def _positions(self):
        return _shard_positions(self.n, self.rank, self.world_size, epoch=self.epoch, seed=self.seed,
                                shuffle=self.shuffle, remainder=self.remainder)

    def __iter__(self):
        return iter(self._positions().tolist())

    def __len__(self):
        return self._len


def _import_neighbor_loader():
    from torch_geometric.loader import NeighborLoader

    return NeighborLoader


class DistributedNeighborLoader(_import_neighbor_loader()):
    """PyG's ``NeighborLoader`` over this rank's share of ``input_nodes`` (all nodes when None):
    each epoch the seeds are split as :func:`split_seeds` does (call :meth:`set_epoch` before
    iterating, as with ``DistributedSampler``), and each batch is sampled with cpu_opt's sampler
    on a random stream of its own, seeded by ``(seed, rank, epoch, step)``.

    ``batch.input_id`` holds the positions of the batch's seeds in ``input_nodes``, ``batch.n_id``
    the global node ids, and the first ``batch.batch_size`` nodes are the seeds, as with
    ``NeighborLoader``. Every rank has ``len(loader)`` batches of the same sizes.

    Keyword arguments go to ``NeighborLoader`` (``replace``, ``subgraph_type``, ``num_workers``,
    ``drop_last``...), except ``shuffle`` (done here, by ``seed`` and epoch) and ``sampler``.
    ``num_workers > 0`` keeps the per-batch seeding (batches go to workers round-robin, each
    worker numbers its own), but not with ``persistent_workers=True``: a persistent worker would
    not see :meth:`set_epoch`, so that is refused.
    """

    def __init__(self, data, num_neighbors, *, batch_size: int, input_nodes=None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, seed: int = 0, shuffle: bool = True, remainder: str = "drop",
                 **kwargs):
        rank, world_size = _rank_world(rank, world_size)
        for bad in ("sampler", "batch_sampler", "shuffle_seed"):
            if bad in kwargs:
                raise TypeError(f"DistributedNeighborLoader chooses the seeds itself: {bad!r} is not accepted")
        if kwargs.get("persistent_workers") and kwargs.get("num_workers", 0) > 0:
            raise ValueError("persistent_workers=True is not supported: persistent DataLoader workers do not see "
                             "set_epoch(), so their sampling could not be seeded per epoch")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        install_sampler()
        if input_nodes is None:
            input_nodes = torch.arange(data.num_nodes)
        input_nodes = _seed_tensor(input_nodes)
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0
        self._shard_sampler = _ShardSampler(input_nodes.numel(), rank, world_size, seed, shuffle, remainder)
        self._step = 0
        super().__init__(data, num_neighbors, input_nodes=input_nodes, batch_size=batch_size, shuffle=False,
                         sampler=self._shard_sampler, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch``'s seed permutation and sampling streams."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch
        self._shard_sampler.epoch = epoch

    @property
    def num_seeds(self) -> int:
        """Seeds per rank per epoch."""
        return len(self._shard_sampler)

    def __iter__(self):
        self._step = 0
        return super().__iter__()

    def _batch_step(self) -> int:
        info = torch.utils.data.get_worker_info()
        step = self._step
        self._step += 1
        if info is None:
            return step
        return step * info.num_workers + info.id  # the DataLoader hands batches to workers round-robin

    def collate_fn(self, index):
        s = _mix(self.seed, self.rank, self.epoch, self._batch_step())
        with torch.random.fork_rng(devices=[]):  # the sampler draws its seed from torch's default generator
            torch.default_generator.manual_seed(s)
            return super().collate_fn(index)


# ----------------------------------------------------------------------------- training

def node_classification_loss(model, batch) -> torch.Tensor:
    """Cross-entropy (mean) of the model's output on the batch's seed nodes: the default step of
    :func:`train_epoch`. ``model(batch.x, batch.edge_index)``, rows ``[:batch.batch_size]``."""
    out = model(batch.x, batch.edge_index)[:batch.batch_size]
    return torch.nn.functional.cross_entropy(out, batch.y[:batch.batch_size])


@dataclasses.dataclass
class EpochStats:
    steps: int            # optimizer steps taken (the same on every rank)
    seeds: int            # seed nodes this rank trained on
    loss: float           # mean over steps of the loss averaged over ranks (what DDP optimises)
    local_loss: float     # this rank's mean loss
    seconds: float        # wall time of the epoch on this rank
    sample_seconds: float  # of which waiting for the loader (sampling and feature gathering)


_COMM_MARKERS = ("gloo", "connection closed", "connection reset", "timed out", "timeout", "broken pipe",
                 "processgroup", "nccl", "socket", "peer")


def _is_comm_error(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _COMM_MARKERS)


def _rank_failure(e: BaseException, where: str) -> RankFailureError:
    import torch.distributed as dist

    who = (f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_available() and dist.is_initialized()
           else "this rank")
    t = f"{_timeout_s:g} s" if _timeout_s is not None else "the process group's timeout"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return RankFailureError(
        f"{who}: a collective failed {where}. Another rank has probably died, hung or left the job (a dead peer is "
        f"noticed when its connection closes, a hung one after the timeout of {t}, set by "
        f"cpu_opt.gnn.distributed.init(timeout=...)); check the other ranks' output. Backend error: "
        f"{type(e).__name__}: {first}")


def _all_reduce(t: torch.Tensor, op, where: str) -> torch.Tensor:
    import torch.distributed as dist

    try:
        dist.all_reduce(t, op=op)
    except Exception as e:
        if _is_comm_error(e):
            raise _rank_failure(e, where) from e
        raise
    return t


def train_epoch(model: torch.nn.Module, loader, optimizer: torch.optim.Optimizer, *,
                loss_fn: Callable = node_classification_loss, max_steps: Optional[int] = None) -> EpochStats:
    """One epoch (or its first ``max_steps`` steps) of mini-batch training of ``model`` (a
    ``DistributedDataParallel``) over ``loader`` (a :class:`DistributedNeighborLoader`, or any
    iterable of batches with the same length on every rank): ``loss_fn(model, batch)`` (mean
    reduction), backward -- where DDP averages the gradients over ranks -- and an optimizer step.

    Before the first step all ranks compare their step counts (one all-reduce) and raise
    ValueError if they differ. A failed collective (a peer died or hung past the timeout) raises
    :class:`RankFailureError`. The epoch's mean loss is all-reduced once at the end.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("train_epoch needs the process group: call cpu_opt.gnn.distributed.init() first")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0):
        raise ValueError(f"max_steps must be an int >= 0 or None, got {max_steps!r}")
    n = len(loader) if max_steps is None else min(len(loader), max_steps)
    counts = _all_reduce(torch.tensor([n, -n], dtype=torch.int64), dist.ReduceOp.MAX,
                         "before the epoch (comparing step counts)")
    if int(counts[0]) != n or int(-counts[1]) != n:
        raise ValueError(f"rank {dist.get_rank()}: the ranks have different numbers of steps this epoch (this one "
                         f"{n}, between {int(-counts[1])} and {int(counts[0])}); DDP would deadlock. Give every rank "
                         "the same number of seeds (split_seeds / DistributedNeighborLoader do)")
    model.train()
    total = torch.zeros((), dtype=torch.float64)
    seeds = steps = 0
    sample_s = 0.0
    t0 = time.perf_counter()
    it = iter(loader)
    try:
        for steps in range(n):
            ts = time.perf_counter()
            batch = next(it)
            sample_s += time.perf_counter() - ts
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            loss.backward()                      # DDP all-reduces the gradients here
            optimizer.step()
            total += loss.detach().to(torch.float64)
            seeds += int(getattr(batch, "batch_size", 0) or 0)
        steps = n
    except Exception as e:
        if _is_comm_error(e):
            raise _rank_failure(e, f"at step {steps} of {n}") from e
        raise
    finally:
        del it
    elapsed = time.perf_counter() - t0
    local = float(total) / max(n, 1)
    glob = _all_reduce(total.clone(), dist.ReduceOp.SUM, "after the epoch (averaging the loss)")
    return EpochStats(steps=n, seeds=seeds, loss=float(glob) / dist.get_world_size() / max(n, 1), local_loss=local,
                      seconds=elapsed, sample_seconds=sample_s)


def free_port() -> int:
    """A TCP port free on localhost right now (for MASTER_PORT in tests and benchmarks)."""
    return _free_port()
