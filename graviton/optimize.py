"""``optimize_for_arm``: what cpu_opt.optimize does on aarch64.

1. Validate the arguments (before anything aarch64-specific, so bad input fails the same way
   everywhere).
2. Choose the math: ``dtype="auto"`` is bf16 fast-math on a core with BF16 (Neoverse V1/V2)
   and strict fp32 elsewhere (N1); ``"bf16"`` on a core without BF16 is an error.
3. Run the model once eagerly on the example inputs, recording each Linear's and Conv2d's input
   shape (the fp32 reference output comes from this run).
4. Replace those layers (in a copy, unless ``inplace=True``) by :mod:`.packed` modules with
   weights prepared once for ACL: packed for the inner product / convolution primitive, or,
   for bf16 without the process-wide fast-math default, routed through oneDNN's matmul.
5. Warm up: run the optimized model on the example inputs, so oneDNN's and ideep's primitive
   caches hold every primitive for these shapes; compare with the eager output.

The returned :class:`ArmOptimizedModule` runs its forward under ``torch.no_grad`` with torch's
run-time fast-math switch set for its dtype (bf16 on, or forced off for fp32) and restored after.
``.report()`` says what was replaced, how, and what was left alone and why.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import fastmath
from ._platform import core_has_bf16, require_arm
from cpu_opt.errors import UnsupportedError

DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def normalize_dtype(dtype) -> str:
    """"auto" / "float32" / "bfloat16" from a string alias or a torch dtype; ValueError otherwise."""
    if dtype is torch.float32:
        return "float32"
    if dtype is torch.bfloat16:
        return "bfloat16"
    if isinstance(dtype, str) and dtype.strip().lower() in DTYPE_ALIASES:
        return DTYPE_ALIASES[dtype.strip().lower()]
    raise ValueError(f"dtype={dtype!r}: expected 'auto', 'float32' (or torch.float32) or 'bfloat16' "
                     f"(or torch.bfloat16; fp32 tensors with bf16 fast-math GEMMs)")


def normalize_inputs(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        for i, t in enumerate(example_inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"example_inputs[{i}] must be a torch.Tensor, got {type(t).__name__}")
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a Tensor or a tuple/list of Tensors, got {type(example_inputs).__name__}")


@dataclass(frozen=True)
class ArmOptions:
    dtype: str = "auto"
    warm: bool = True
    pack_weights: bool = True
    inplace: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        for name in ("warm", "pack_weights", "inplace"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")


@dataclass
class ArmReport:
    core: str | None
    core_has_bf16: bool
    dtype: str                       # what runs: "float32" or "bfloat16" (fast-math)
    requested: str
    process_fpmath: str              # "bf16" / "f32": oneDNN's default in this process
    linear_mode: str | None = None
    replaced: list = field(default_factory=list)     # (qualified name, what it became)
    left: list = field(default_factory=list)         # (qualified name, why it stayed)
    notes: list = field(default_factory=list)
    warm_check: dict | None = None   # cosine / max abs diff of the warm-up output vs eager fp32

    def text(self) -> str:
        lines = [f"cpu_opt.graviton: {self.core or 'unknown core'} (BF16: {'yes' if self.core_has_bf16 else 'no'}), "
                 f"dtype={self.requested} -> {self.dtype}"
                 + (" (bf16 fast-math: fp32 tensors, bf16 multiplies in ACL GEMMs)" if self.dtype == "bfloat16" else ""),
                 f"  oneDNN default fpmath in this process: {self.process_fpmath}"]
        for name, what in self.replaced:
            lines.append(f"  replaced {name}: {what}")
        for name, why in self.left:
            lines.append(f"  left {name}: {why}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.warm_check:
            lines.append("  warm-up vs eager fp32: " + ", ".join(f"{k}={v:.6g}" for k, v in self.warm_check.items()))
        return "\n".join(lines)


class ArmOptimizedModule(nn.Module):
    """The model with ACL-ready layers; forward runs under no_grad with this module's fast-math setting."""

    def __init__(self, model: nn.Module, fast_math_on: bool, report: ArmReport):
        super().__init__()
        self.model = model
        self.fast_math_on = fast_math_on
        self._report = report

    def forward(self, *args, **kwargs):
        with torch.no_grad(), fastmath.fast_math(self.fast_math_on):
            return self.model(*args, **kwargs)

    def report(self) -> dict:
        """The same keys as ``cpu_opt.optimize(...).report()`` and ``gnn.optimize(...).report()``
        (``capability``, ``dtype``, ``partitions``, ``fallbacks``, ``routed``, ``notes``,
        ``validation``, ``counts``); :meth:`report_text` prints it."""
        r = self._report
        return {
            "capability": "graviton", "dtype": r.dtype, "requested_dtype": r.requested,
            "num_partitions": 0, "partitions": [],
            "fallbacks": [{"node": name, "op": "", "reason": why} for name, why in r.left],
            "routed": [{"node": name, "op": "", "route": "acl", "why": what} for name, what in r.replaced],
            "notes": [f"{r.core or 'unknown core'} (BF16: {'yes' if r.core_has_bf16 else 'no'}); oneDNN default "
                      f"fpmath in this process: {r.process_fpmath}"] + list(r.notes),
            "validation": dict(r.warm_check) if r.warm_check else None, "counts": {},
        }

    def report_text(self) -> str:
        return self._report.text()

    @property
    def plan(self) -> ArmReport:
        return self._report


def _outputs_flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs_flat(o)]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _outputs_flat(v)]
    return []


def compare(out, ref) -> dict:
    """Cosine similarity and max abs difference over all float outputs (float64 arithmetic)."""
    a = [t.detach().double().flatten() for t in _outputs_flat(out) if t.is_floating_point()]
    b = [t.detach().double().flatten() for t in _outputs_flat(ref) if t.is_floating_point()]
    if not a or len(a) != len(b):
        return {}
    a, b = torch.cat(a), torch.cat(b)
    cos = float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))
    return {"cosine": cos, "max_abs_diff": float((a - b).abs().max())}


def _record_shapes(model: nn.Module, inputs: tuple) -> tuple[dict, object]:
    shapes, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            def pre(mod, args, _name=name):
                if args and isinstance(args[0], torch.Tensor):
                    shapes.setdefault(_name, tuple(args[0].shape))
            hooks.append(m.register_forward_pre_hook(pre))
    try:
        with torch.no_grad(), fastmath.fast_math(False):
            ref = model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return shapes, ref


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def optimize_for_arm(model: nn.Module, example_inputs, dtype="auto", *, warm: bool = True,
                     pack_weights: bool = True, inplace: bool = False) -> ArmOptimizedModule:
    """Prepare ``model`` for inference on an aarch64 core through ACL (see the module doc).

    ``dtype``: "auto" (bf16 fast-math where the core has BF16, else fp32), "float32", or
    "bfloat16" (fast-math; an error on a core without BF16). ``warm``: run the example inputs
    once so every primitive for these shapes is created now. ``pack_weights``: replace Linear
    and Conv2d layers by weight-prepared ones (False keeps the model's layers and only applies
    the fast-math setting). ``inplace``: modify ``model`` instead of a deep copy.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = normalize_inputs(example_inputs)
    opts = ArmOptions(dtype=dtype, warm=warm, pack_weights=pack_weights, inplace=inplace)
    require_arm("optimize_for_arm")

    has_bf16, core = core_has_bf16()
    if opts.dtype == "bfloat16" and not has_bf16:
        raise UnsupportedError(f"dtype='bfloat16' needs BF16 instructions, which {core or 'this core'} lacks "
                               "(Neoverse V1/V2 have them, N1 does not); use dtype='auto' or 'float32'")
    run_dtype = opts.dtype if opts.dtype != "auto" else ("bfloat16" if has_bf16 else "float32")
    bf16 = run_dtype == "bfloat16"
    process_fpmath = fastmath.process_fast_math()
    report = ArmReport(core=core, core_has_bf16=has_bf16, dtype=run_dtype, requested=opts.dtype,
                       process_fpmath=process_fpmath)
    if not bf16 and process_fpmath == "bf16":
        msg = ("fp32 was chosen but this process runs oneDNN with DNNL_DEFAULT_FPMATH_MODE=BF16 (set before "
               "oneDNN's first use, e.g. by CPU_OPT_FAST_MATH=1): GEMMs will use bf16 multiplies anyway")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        report.notes.append(msg)

    if model.training:
        report.notes.append("model was in training mode: switched to eval() (inference only)")
    target = model if opts.inplace else copy.deepcopy(model)
    target.eval()

    shapes, ref = _record_shapes(target, inputs)

    if opts.pack_weights:
        # bf16 without the process default: the packed inner product would stay fp32, so Linear
        # goes through oneDNN's matmul, which the run-time switch does reach.
        linear_mode = "matmul" if (bf16 and process_fpmath != "bf16") else "packed"
        report.linear_mode = linear_mode
        if linear_mode == "matmul":
            report.notes.append("Linear weights are converted to bf16 layout on each call (no process-wide "
                                "fast-math); export CPU_OPT_FAST_MATH=1 before starting Python to pack them once")
        for name, m in list(target.named_modules()):
            if isinstance(m, nn.Linear) and type(m) is not nn.Linear and not isinstance(
                    m, nn.modules.linear.NonDynamicallyQuantizableLinear):
                report.left.append((name, f"{type(m).__name__} is a Linear subclass; left as is"))
                continue
            if isinstance(m, nn.Linear):
                if m.weight.dtype != torch.float32:
                    report.left.append((name, f"weight dtype {m.weight.dtype}, not fp32"))
                    continue
                if name not in shapes and linear_mode == "packed":
                    report.left.append((name, "not run by the example inputs (no shape to pack for)"))
                    continue
                batch = None
                if name in shapes:
                    batch = 1
                    for s in shapes[name][:-1]:
                        batch *= s
                new = PackedLinear(m, linear_mode, batch)
                _set_submodule(target, name, new)
                what = ("ACL inner product, weight packed once"
                        + (" in bf16 layout (process fast-math)" if process_fpmath == "bf16" else " (fp32)")
                        if linear_mode == "packed" else "ACL matmul via oneDNN (bf16 fast-math), bias added after")
                report.replaced.append((name, what))
            elif isinstance(m, nn.Conv2d):
                if m.weight.dtype != torch.float32:
                    report.left.append((name, f"weight dtype {m.weight.dtype}, not fp32"))
                elif m.padding_mode != "zeros" or isinstance(m.padding, str):
                    report.left.append((name, f"padding={m.padding!r}/{m.padding_mode}: not packed"))
                elif name not in shapes:
                    report.left.append((name, "not run by the example inputs (no shape to pack for)"))
                else:
                    new = PackedConv2d(m, shapes[name])
                    _set_submodule(target, name, new)
                    report.replaced.append((name, "ACL convolution, weight packed once"
                                            + (" in bf16 layout (process fast-math)" if process_fpmath == "bf16"
                                               else ", converted to bf16 on each call by the run-time switch" if bf16
                                               else " (fp32)")))
    out_mod = ArmOptimizedModule(target, fast_math_on=bf16, report=report)
    if opts.warm:
        out = out_mod(*inputs)
        report.warm_check = compare(out, ref)
    return out_mod


from .packed import PackedConv2d, PackedLinear  # noqa: E402  (torch-dependent, after the helpers)
