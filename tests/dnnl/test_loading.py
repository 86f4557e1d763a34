"""Loading libdnnl: a missing library gives a clear error naming what to install, in a fresh
process (the library is loaded once per process)."""
import json
import subprocess
import sys


def _run(code, env_extra):
    import os

    env = dict(os.environ, **env_extra)
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


def test_info_json_keys_and_isa_cap():
    r = _run("from cpu_opt.__main__ import main; main(['info', '--json'])", {})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("arch", "isa", "routes", "onednn", "torch"):
        assert key in d
    assert not any(f.startswith("amx") for f in d["isa"]) or "amx_tile" in d["isa"]
    capped = json.loads(_run("from cpu_opt.__main__ import main; main(['info', '--json'])",
                             {"CPU_OPT_MAX_ISA": "avx2"}).stdout)
    assert "avx512_bf16" not in capped["isa"] and "avx512_vnni" not in capped["isa"]
    assert capped["isa_cap"] == "avx2"
    # int8 GEMM cannot use VNNI kernels under the cap
    assert capped["routes"]["gemm"]["int8"]["backend"] != "onednn"
    assert capped["routes"]["gemm"]["bf16"]["backend"] == "torch"
