"""Shared by tests/optimize: which side of the routing conditions this machine (after the ISA cap)
is on, so every test asserts the behaviour of its side — oneDNN partitions where routing sends
work to oneDNN, the whole graph in torch (and a report that says so) where it does not."""
import sys
from pathlib import Path

import pytest

from cpu_opt.backends.onednn_graph import PartitionStep

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def partition_calls(monkeypatch):
    """The index of every oneDNN Graph partition call made during the test, in order."""
    calls = []
    real = PartitionStep.__call__

    def counting(self, *a):
        calls.append(self.index)
        return real(self, *a)

    monkeypatch.setattr(PartitionStep, "__call__", counting)
    return calls
