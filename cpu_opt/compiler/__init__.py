"""The compiler behind ``cpu_opt.optimize``, one straight line (DESIGN.md, "How data flows"):

* ``capture.py`` — model + example inputs -> an ATen-level FX graph with shapes (``torch.export``)
* ``passes/`` — graph passes, one file per family (clean-up, folding, linear and attention routing)
* ``lowering.py`` — FX nodes -> oneDNN Graph ops -> partitions
* ``plan.py`` — everything compiled for one input signature (passes, lowering, runtime program)
* ``runtime.py`` — the runnable program: partition steps (:mod:`cpu_opt.backends.onednn_graph`)
  and torch calls, buffers reused only where no caller can see them
* ``pipeline.py`` — ``optimize`` and the :class:`OptimizedModule` it returns (plans per shape,
  validation against eager, the report)
* ``buckets.py`` — ``optimize(..., buckets=)``: inputs padded to bucket lengths, outputs sliced back
* ``generate.py`` — ``generate()`` on an optimized causal LM
"""
