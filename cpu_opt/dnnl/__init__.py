"""cpu_opt's binding of oneDNN (libdnnl from the ``onednn-cpu-gomp`` wheel), through cffi.

* :mod:`.lib` — loading, engine/stream, status → exception (:class:`cpu_opt.errors.DnnlError`)
* :mod:`.memory` — memory descriptors and zero-copy memory over torch tensors
* :mod:`.primitives` — matmul, inner product, 2-D convolution, reorder (weights packed once)
* :mod:`.graph` — the Graph API: logical tensors, ops, partitions, compiled partitions
* :mod:`.cache` — the LRU primitive cache with hit/miss counters

To see which kernels ran, set ``ONEDNN_VERBOSE=1`` (each primitive and its ISA) or
``ONEDNN_VERBOSE=dispatch`` (why implementations were skipped) before the first call.
"""
from .lib import available, check, engine, library_path, version, version_info  # noqa: F401
from .cache import CACHE, set_capacity, stats as cache_stats  # noqa: F401
