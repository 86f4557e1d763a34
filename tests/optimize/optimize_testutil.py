"""Helpers for tests/optimize (imported by name: conftest.py puts this folder on sys.path)."""
from cpu_opt import routing
from cpu_opt.compiler import plan


def onednn_graph_used(dtype: str = "fp32") -> bool:
    """Does optimize hand ``dtype`` graphs to oneDNN here (the library takes the dtype at this ISA and
    routing sends some GEMM/conv work of it to oneDNN)?"""
    return plan.why_not_onednn(dtype) is None


def conv_on_onednn(dtype: str = "fp32") -> bool:
    return onednn_graph_used(dtype) and routing.route("conv", dtype).backend == "onednn"


def assert_whole_graph_in_torch(rep: dict) -> None:
    """The report of a model optimize kept in torch because of routing: no partitions, and says why."""
    assert rep["num_partitions"] == 0 and not rep["partitions"]
    assert any("runs in torch on this CPU" in p for p in rep["passes"]), rep["passes"]


def count_fused_attention_calls(monkeypatch, getter: str) -> list:
    """Patch ``cpu_opt.backends.attention.<getter>`` (``_dpbf16_kernel``, ``_dpbf16_bf16out_kernel``,
    ``_f32_kernel``: the native kernel, or None where it cannot run) so that every call of the kernel
    it hands out is recorded as its (B, H, kv heads) arguments; returns that list."""
    from cpu_opt.backends import attention as battn

    calls = []
    real = getattr(battn, getter)

    def counting():
        fn = real()
        if fn is None:
            return None

        def wrapped(*a):
            calls.append(a[9:12])   # B, H, kv heads
            return fn(*a)
        return wrapped

    monkeypatch.setattr(battn, getter, counting)
    return calls
