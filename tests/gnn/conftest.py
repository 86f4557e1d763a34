"""tests/gnn: puts gnn_testutil (shared helpers) on the import path and clears the sort cache
between tests."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _fresh_sort_cache():
    from cpu_opt.gnn import sort_cache

    sort_cache.clear()
    yield
