"""Shared by tests/optimize: which side of the routing conditions this machine (after the ISA cap)
is on, so every test asserts the behaviour of its side — oneDNN partitions where routing sends
work to oneDNN, the whole graph in torch (and a report that says so) where it does not."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
