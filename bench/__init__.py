"""cpu_opt benchmarks. `python -m bench` runs them all; `python -m bench NAME` runs one.

Benchmarks are not tests: each prints a table of medians and ratios measured side by side in
one process and writes JSON under bench/results/.
"""
