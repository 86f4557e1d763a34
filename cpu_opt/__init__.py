"""cpu_opt: make PyTorch models run fast on CPUs without rewriting them.

    import cpu_opt
    fast = cpu_opt.optimize(model, example_input)        # dtype="auto": bf16 where the CPU has it
    fast = torch.compile(model, backend="cpu_opt")       # the same lowering, as a dynamo backend
    served = cpu_opt.optimize(model, example, buckets=cpu_opt.Buckets(sizes=(32, 64, 128)))  # padded lengths

``python -m cpu_opt info`` prints what was detected and where each kind of work is routed.
"""
# First, before anything imports torch: on aarch64 this applies the CPU_OPT_* start-up opt-ins
# (DNNL_DEFAULT_FPMATH_MODE must be in the environment before torch loads oneDNN). No torch here.
from . import graviton as _graviton  # noqa: E402,F401
from .platform import hw as _hw  # noqa: E402

# CPU_OPT_MAX_ISA caps the oneDNN inside torch as well as cpu_opt's own (both read
# ONEDNN_MAX_CPU_ISA at their first primitive), so routes to either run what the cap allows.
_hw.export_cap()

__version__ = "0.1.0"


def optimize(model, example_inputs, **kwargs):
    """See :func:`cpu_opt.compiler.pipeline.optimize`."""
    from .compiler.pipeline import optimize as _optimize

    return _optimize(model, example_inputs, **kwargs)


def __getattr__(name):
    if name == "Buckets":  # optimize(..., buckets=cpu_opt.Buckets(...)); imported on first use
        from .compiler.buckets import Buckets

        return Buckets
    raise AttributeError(f"module 'cpu_opt' has no attribute {name!r}")


def _register_dynamo_backend() -> None:
    try:
        from torch._dynamo import register_backend
    except Exception:  # pragma: no cover - torch without dynamo
        return
    from .backend import cpu_opt_backend

    try:
        register_backend(name="cpu_opt")(cpu_opt_backend)
    except Exception:  # already registered (re-import)
        pass


_register_dynamo_backend()
