"""Loading libdnnl: a missing library gives a clear error naming what to install, in a fresh
process (the library is loaded once per process)."""
import json
import subprocess
import sys


CAP_VARIABLES = ("CPU_OPT_MAX_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def _run(code, env_extra):
    """A fresh process with exactly the ISA cap variables in ``env_extra`` (the capped run of
    `make test` exports its own, which would otherwise leak in)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in CAP_VARIABLES}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_missing_libdnnl_raises_clear_error():
    r = _run("from cpu_opt import dnnl\n"
             "try:\n    dnnl.version()\nexcept Exception as e:\n    print(type(e).__name__, '|', e)\n",
             {"CPU_OPT_LIBDNNL": "/nonexistent/libdnnl.so.3"})
    assert r.returncode == 0, r.stderr
    assert "DnnlUnavailableError" in r.stdout
    assert "onednn-cpu-gomp" in r.stdout and "/nonexistent/libdnnl.so.3" in r.stdout
    assert not dnnl_available_in(r.stdout)


def dnnl_available_in(text):
    return "3." in text.split("|")[0]


def test_override_path_is_used():
    from cpu_opt import dnnl

    real = dnnl.library_path()
    r = _run("from cpu_opt import dnnl; print(dnnl.library_path())", {"CPU_OPT_LIBDNNL": real})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == real


INFO_JSON = "from cpu_opt.__main__ import main; main(['info', '--json'])"


def _proc_flags() -> set:
    """The flags line of /proc/cpuinfo, read here independently of cpu_opt.hw."""
    from pathlib import Path

    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_info_json_features_are_exactly_what_proc_cpuinfo_and_the_os_give():
    from cpu_opt import hw

    r = _run(INFO_JSON, {})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("arch", "isa", "isa_uncapped", "flags", "routes", "onednn", "torch", "onednn_matmul"):
        assert key in d
    flags = _proc_flags()
    assert flags, "no flags line in /proc/cpuinfo"
    if hw._amx_os_enabled() is False:
        flags -= hw.AMX_FEATURES  # the CPU has AMX, the kernel does not give it tile state
    assert set(d["flags"]) == flags
    known = hw.X86_FEATURES if d["arch"] == "x86_64" else hw.ARM_FEATURES
    assert set(d["isa_uncapped"]) == {f for f in known if f in flags}
    assert d["isa"] == d["isa_uncapped"] and d["isa_cap"] is None
    # the native variant and the oneDNN probe agree with those features
    from cpu_opt import native

    assert set(native.VARIANT_REQUIRES[d["native_variant"]]) <= set(d["isa"])


def test_info_json_under_a_cap():
    capped = json.loads(_run(INFO_JSON, {"CPU_OPT_MAX_ISA": "avx2"}).stdout)
    assert "avx512_bf16" not in capped["isa"] and "avx512_vnni" not in capped["isa"]
    assert capped["isa_cap"] == "avx2" and capped["isa_cap_source"] == "CPU_OPT_MAX_ISA"
    assert not [f for f in capped["isa"] if f.startswith(("avx512", "amx"))]
    assert set(capped["isa_uncapped"]) >= set(capped["isa"])
    # int8 GEMM cannot use VNNI kernels under the cap, and oneDNN 3.2 takes no bf16 below avx512_core
    assert capped["routes"]["gemm"]["int8"]["backend"] != "onednn"
    assert capped["routes"]["gemm"]["bf16"]["backend"] == "torch"
    assert capped["onednn_matmul"]["bf16"]["accepted"] is False


def test_onednn_own_cap_variable_caps_the_routes_too():
    """A user who sets only ONEDNN_MAX_CPU_ISA gets routes for what oneDNN will really run."""
    d = json.loads(_run(INFO_JSON, {"ONEDNN_MAX_CPU_ISA": "SSE41"}).stdout)
    assert d["isa_cap"] == "sse41" and d["isa_cap_source"] == "ONEDNN_MAX_CPU_ISA"
    assert "avx2" not in d["isa"]
    assert d["native_variant"] == "base"
    both = json.loads(_run(INFO_JSON, {"ONEDNN_MAX_CPU_ISA": "AVX2", "CPU_OPT_MAX_ISA": "sse41"}).stdout)
    assert both["isa_cap"] == "sse41"  # the lower of the two


def test_constant_tensor_cache_is_on_once_the_engine_exists():
    """Partitions keep their packed weights across calls (DESIGN: weights packed once)."""
    from cpu_opt.dnnl import lib as L

    L.engine()
    assert L.constant_cache_enabled()
    L.check(L.lib().dnnl_graph_set_constant_tensor_cache(0), "off")  # as a library default could be
    try:
        assert not L.constant_cache_enabled()
        L.configure_graph()
        assert L.constant_cache_enabled()
    finally:
        L.configure_graph()
