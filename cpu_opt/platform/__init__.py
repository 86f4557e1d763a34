"""What this machine is and where work goes on it.

* :mod:`.hw` — feature detection (``/proc/cpuinfo``, py-cpuinfo, torch, the OS for AMX) and the
  ``CPU_OPT_MAX_ISA`` cap;
* :mod:`.routing` — the routing table (rules on features, each citing its measurement) and the
  measured profile's overrides;
* :mod:`.profile` — ``python -m cpu_opt calibrate``: the micro-benchmarks behind a measured profile,
  and the on-disk cache it is kept in.
"""
