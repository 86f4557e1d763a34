"""cpu_opt's oneDNN 3.2 Graph partitions as a runtime step: :class:`PartitionStep` compiles a
partition for the strides of the tensors it first sees (cached by signature), binds torch storage to
oneDNN tensors without copies, and reuses its output buffers across calls where the runtime says no
caller can see them (per thread)."""
from __future__ import annotations

import threading

import torch

from ..dnnl import graph as G


class PartitionStep:
    """Callable for one oneDNN partition: ``step(*inputs) -> tuple(outputs)``."""

    def __init__(self, index: int, partition: G.Partition, input_ids: list[int], output_ids: list[int],
                 consts: dict, reuse_outputs: list[bool], channels_last_out: bool, out_strides=None):
        self.index = index
        self.partition = partition
        self.input_ids = input_ids      # lt ids, in the partition's input-port order (runtime args)
        self.output_ids = output_ids
        self.consts = consts            # position -> tensor for scalar constants
        self.reuse = reuse_outputs
        self.channels_last_out = channels_last_out
        # per output: the strides the captured graph's metadata gives that value (what its consumers,
        # a later .view() among them, were traced against), or None for values no FX node stands for
        self.out_strides = list(out_strides) if out_strides is not None else [None] * len(output_ids)
        # input positions whose tensor no later step reads and whose memory no caller sees (set by the
        # runtime): where the compiled partition can write an output in that input's place, it does
        self.donate: set = set()
        self._compiled: dict = {}
        self._tls = threading.local()   # reused output buffers: per thread, so concurrent calls never share
        self.__name__ = f"onednn_partition_{index}"

    def _compile(self, inputs):
        ins = []
        for lt, t in zip(self.partition.inputs, inputs):
            ins.append(G.LogicalTensor(lt.id, tuple(t.shape), t.dtype, tuple(t.stride()), "strided", lt.constant))
        outs = []
        for lt, want in zip(self.partition.outputs, self.out_strides):
            shape = lt.shape
            if want is not None:
                strides = want
            elif self.channels_last_out and len(shape) == 4:
                strides = torch.empty(shape, device="meta").contiguous(memory_format=torch.channels_last).stride()
            else:
                strides = G._contiguous_strides(shape)
            outs.append(G.LogicalTensor(lt.id, shape, lt.dtype, tuple(strides), "strided", False))
        return self.partition.compile(ins, outs)

    def __call__(self, *inputs):
        if self.consts:
            inputs = list(inputs)
            for pos, t in self.consts.items():
                inputs.insert(pos, t)
        sig = tuple((t.shape, t.stride(), t.dtype) for t in inputs)
        cp = self._compiled.get(sig)
        if cp is None:
            cp = self._compiled[sig] = self._compile(inputs)
        per_thread = getattr(self._tls, "buffers", None)
        if per_thread is None:
            per_thread = self._tls.buffers = {}
        bufs = per_thread.get(sig)
        if bufs is None:
            outs = cp.new_outputs()
            per_thread[sig] = [b if r else None for b, r in zip(outs, self.reuse)]
        else:
            outs = [b if b is not None else torch.empty_strided(lt.shape, lt.strides, dtype=lt.dtype)
                    for b, lt in zip(bufs, cp.outputs)]
        for i, j in cp.inplace if self.donate else ():
            t, lt = inputs[i], cp.outputs[j]
            if i in self.donate and self.reuse[j] and t.dtype == lt.dtype and tuple(t.shape) == tuple(lt.shape) \
                    and tuple(t.stride()) == tuple(lt.strides):
                outs[j] = t   # a residual's dead buffer takes the sum: no copy of it into a new one
        cp.run_unchecked(list(inputs), outs)  # the signature picked ``cp``; the buffers are its own
        return tuple(outs)

    @property
    def op_kinds(self) -> list[str]:
        return self.partition.op_kinds
