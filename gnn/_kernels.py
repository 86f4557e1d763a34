"""Thin Python wrappers over the C kernels in native/kernels/{segment,segment_backward,csr,gather}.c.

Each wrapper checks types and shapes (TypeError / ValueError naming the argument), allocates the
output, calls the variant :func:`cpu_opt.native.kernel` picks, and turns the kernel's status into
an exception: the kernels check every index before touching memory, so a bad index raises
``IndexError`` naming the position and nothing has been written. These functions know nothing of
autograd; :mod:`cpu_opt.gnn.ops` wraps them as torch custom ops.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

from cpu_opt import native
from cpu_opt._memory import holds_its_values, overlaps

FEATURE_DTYPES = {torch.float32: ("f32", "float *"), torch.float64: ("f64", "double *"),
                  torch.bfloat16: ("bf16", "uint16_t *")}
INDEX_DTYPES = {torch.int64: ("i64", "int64_t *"), torch.int32: ("i32", "int32_t *")}
REDUCE_CODES = {"sum": 0, "mean": 1, "amax": 2, "amin": 3, "prod": 4}
REDUCE_ALIASES = {"add": "sum", "max": "amax", "min": "amin", "mul": "prod"}

_state = threading.local()


@contextlib.contextmanager
def use_variant(variant: str | None):
    """Run the GNN kernels with one ISA variant ('base', 'avx2', 'avx512'), e.g. to test them
    against each other. ``None`` restores the automatic choice."""
    old = getattr(_state, "variant", None)
    _state.variant = variant
    try:
        yield
    finally:
        _state.variant = old


_fn_cache: dict = {}


def _fn(name: str):
    """The kernel for this CPU (or the variant forced by use_variant), looked up once."""
    key = (name, getattr(_state, "variant", None), os.environ.get("CPU_OPT_MAX_ISA"),
           os.environ.get("ONEDNN_MAX_CPU_ISA"))  # both caps decide the variant (hw.isa_cap_from_env)
    fn = _fn_cache.get(key)
    if fn is None:
        fn = _fn_cache[key] = native.kernel(name, key[1])
    return fn


def variant() -> str:
    """The variant the kernels run here: the one use_variant forces, else this CPU's (under the ISA cap)."""
    return getattr(_state, "variant", None) or native.select_variant()


def _nthreads() -> int:
    return max(1, torch.get_num_threads())


def canonical_reduce(reduce: str, allowed=tuple(REDUCE_CODES)) -> str:
    if not isinstance(reduce, str):
        raise TypeError(f"reduce must be a str, got {type(reduce).__name__}")
    r = REDUCE_ALIASES.get(reduce, reduce)
    if r not in allowed:
        raise ValueError(f"reduce must be one of {sorted(set(allowed))} (or aliases "
                         f"{[a for a, b in REDUCE_ALIASES.items() if b in allowed]}), got {reduce!r}")
    return r


def check_tensor(t, name: str, *, dtypes=None, dim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if not holds_its_values(t):  # the kernels read data_ptr(): a lazy negation would be lost
        raise ValueError(f"{name} is a lazily {'negated' if t.is_neg() else 'conjugated'} view; "
                         "call .resolve_neg() / .resolve_conj() first")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got {t.dim()}-D of shape {tuple(t.shape)}")
    return t


def _feat(t, name, dim=2):
    check_tensor(t, name, dtypes=FEATURE_DTYPES, dim=dim)
    return t.contiguous()


def _idx(t, name):
    check_tensor(t, name, dtypes=INDEX_DTYPES, dim=1)
    return t.contiguous()


def _p(t, ctype):
    return native.ffi().cast(ctype, t.data_ptr()) if t is not None else native.ffi().NULL


def _raise_index(kernel: str, status: int, bad: int, idx_name: str, idx: torch.Tensor | None, bound,
                 rowptr: torch.Tensor | None = None):
    if status == -1:
        val = int(idx[bad]) if idx is not None and 0 <= bad < idx.numel() else "?"
        raise IndexError(f"{kernel}: {idx_name}[{bad}] = {val} is out of range [0, {bound})")
    if status == -3:
        raise ValueError(f"{kernel}: rowptr must start at 0 and never decrease; "
                         f"rowptr[{bad}] = {int(rowptr[bad]) if rowptr is not None else '?'} breaks that")
    native.check(status, kernel)


def _check_rowptr(rowptr, n_rows_hint=None):
    rowptr = check_tensor(rowptr, "rowptr", dtypes=(torch.int64,), dim=1).contiguous()
    if rowptr.numel() < 1:
        raise ValueError("rowptr must have at least one entry (n_rows + 1)")
    return rowptr


# ----------------------------------------------------------------------------- forward

def segment_reduce(rowptr, col, weight, x, reduce: str, self=None, include_self: bool = False,
                   want_arg: bool = True, mask: bool = False):
    """``out[r] = reduce_{e in [rowptr[r], rowptr[r+1])} weight[e] * x[col[e]]`` (see segment.c).

    Returns ``(out, arg)``; for amax/amin ``arg`` (int32, n_rows x F) holds the winning nonzero
    relative to its row start (``e = rowptr[r] + arg[r, j]``), -1 where self or nothing won; an
    empty tensor for the other reductions, and for amax/amin with ``want_arg=False`` (no gradient
    wanted: the kernel then skips tracking the winners, about half its time).
    ``mask=True`` returns the winners as a bit mask instead (int64 words, nnz x ceil(F / 64): bit
    ``j % 64`` of word ``j // 64`` of nonzero e is set iff e won feature j of its row; see
    :func:`use_winner_mask`)."""
    reduce = canonical_reduce(reduce)
    rowptr = _check_rowptr(rowptr)
    col = _idx(col, "col")
    x = _feat(x, "x")
    n_rows = rowptr.numel() - 1
    F = x.shape[1]
    if weight is not None:
        weight = _feat(weight, "weight", dim=1)
        if weight.dtype != x.dtype:
            raise TypeError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
        if weight.numel() != col.numel():
            raise ValueError(f"weight must have one entry per nonzero ({col.numel()}), got {weight.numel()}")
    if self is not None:
        self = _feat(self, "self")
        if self.dtype != x.dtype:
            raise TypeError(f"self dtype {self.dtype} must match x dtype {x.dtype}")
        if tuple(self.shape) != (n_rows, F):
            raise ValueError(f"self must have shape {(n_rows, F)}, got {tuple(self.shape)}")
    nnz_last = int(rowptr[-1])
    if nnz_last != col.numel():
        raise ValueError(f"rowptr[-1] = {nnz_last} must equal the number of nonzeros col.numel() = {col.numel()}")
    dt, ct = FEATURE_DTYPES[x.dtype]
    isuf, ict = INDEX_DTYPES[col.dtype]
    out = native.empty(n_rows, F, dtype=x.dtype)
    want_arg = want_arg and reduce in ("amax", "amin")
    index = wmask = None  # what the kernel fills: the int32 winner index or the winner bit mask
    if want_arg and mask:
        wmask = native.empty(col.numel(), mask_words(F), dtype=torch.int64)
    elif want_arg:
        index = native.empty(n_rows, F, dtype=torch.int32)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"segment_reduce_{dt}_{isuf}")(
        _p(rowptr, "int64_t *"), n_rows, _p(col, ict), _p(weight, ct), _p(x, ct), x.shape[0], F,
        REDUCE_CODES[reduce], _p(self, ct), int(bool(include_self)), _p(out, ct),
        _p(index, "int32_t *"), _p(wmask, "uint64_t *"), _nthreads(), bad)
    if st:
        _raise_index("segment_reduce", st, bad[0], "col", col, x.shape[0], rowptr)
    if wmask is not None:
        return out, wmask
    return out, index if index is not None else torch.empty(0, dtype=torch.int32)


def mask_words(F: int) -> int:
    """64-bit words of the winner mask per nonzero for F features."""
    return (F + 63) // 64


def use_winner_mask(nnz: int, n_rows: int, F: int) -> bool:
    """Whether max/min spmm records its winners as a bit mask per nonzero (8 bytes per 64
    features) rather than an int32 index per output row and feature: whichever is smaller, i.e.
    the mask while the average degree is below about 32. The mask's backward also skips the
    gradient rows of nonzeros that won nothing."""
    return nnz * mask_words(F) * 8 <= n_rows * F * 4


# ----------------------------------------------------------------------------- backward

def sddmm(rowptr, col, a, b):
    """``out[e] = <a[row(e)], b[col[e]]>`` for every nonzero (the edge-weight gradient of sum spmm)."""
    rowptr = _check_rowptr(rowptr)
    col = _idx(col, "col")
    a = _feat(a, "a")
    b = _feat(b, "b")
    n_rows = rowptr.numel() - 1
    if a.shape[0] != n_rows or a.shape[1] != b.shape[1] or a.dtype != b.dtype:
        raise ValueError(f"a must be ({n_rows}, F) and b (n, F) of one dtype; got {tuple(a.shape)} "
                         f"{a.dtype} and {tuple(b.shape)} {b.dtype}")
    if int(rowptr[-1]) != col.numel():
        raise ValueError("rowptr[-1] must equal col.numel()")
    dt, ct = FEATURE_DTYPES[a.dtype]
    isuf, ict = INDEX_DTYPES[col.dtype]
    out = torch.empty(col.numel(), dtype=a.dtype)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"sddmm_{dt}_{isuf}")(_p(rowptr, "int64_t *"), n_rows, _p(col, ict), b.shape[0], a.shape[1],
                                   _p(a, ct), _p(b, ct), _p(out, ct), _nthreads(), bad)
    if st:
        _raise_index("sddmm", st, bad[0], "col", col, b.shape[0], rowptr)
    return out


def _winners(arg, g, rowptr):
    arg = check_tensor(arg, "arg", dtypes=(torch.int32,), dim=2).contiguous()
    g = _feat(g, "grad")
    if arg.shape != g.shape:
        raise ValueError(f"arg shape {tuple(arg.shape)} must equal grad shape {tuple(g.shape)}")
    rowptr = _check_rowptr(rowptr)
    if rowptr.numel() != g.shape[0] + 1:
        raise ValueError(f"rowptr must have one entry per row of grad plus one ({g.shape[0] + 1}), "
                         f"got {rowptr.numel()}")
    return arg, g, rowptr


def _raise_winner(kernel, st, bad, arg, rowptr, col, n_out):
    if st == -1 and bad <= -2:
        _raise_index(kernel, st, -2 - bad, "col", col, n_out)
    if st == -1:
        F = arg.shape[1]
        r = bad // F
        raise IndexError(f"{kernel}: arg[{r}, {bad % F}] = {int(arg.view(-1)[bad])} is not -1 or a position in "
                         f"row {r} (which has {int(rowptr[r + 1] - rowptr[r])} nonzeros)")
    _raise_index(kernel, st, bad, "arg", None, None, rowptr)


def arg_scatter(arg, g, rowptr, col, weight, n_out: int):
    """``out = zeros(n_out, F); out[col[e], j] += weight[e] * g[r, j]`` for each winner
    ``e = rowptr[r] + arg[r, j]`` (arg >= 0). ``col=None`` means e itself is the row of out."""
    arg, g, rowptr = _winners(arg, g, rowptr)
    nnz = int(rowptr[-1])
    if col is not None:
        col = _idx(col, "col")
        if col.numel() != nnz:
            raise ValueError(f"col must have rowptr[-1] = {nnz} entries, got {col.numel()}")
    if weight is not None:
        weight = _feat(weight, "weight", dim=1)
        if weight.numel() != nnz or weight.dtype != g.dtype:
            raise ValueError("weight must have one entry per nonzero and grad's dtype")
    dt, ct = FEATURE_DTYPES[g.dtype]
    isuf, ict = INDEX_DTYPES[col.dtype] if col is not None else ("i64", "int64_t *")
    out = native.empty(n_out, g.shape[1], dtype=g.dtype)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"arg_scatter_{dt}_{isuf}")(_p(arg, "int32_t *"), g.shape[0], g.shape[1], _p(g, ct),
                                         _p(rowptr, "int64_t *"), _p(col, ict), _p(weight, ct), _p(out, ct), n_out,
                                         _nthreads(), bad)
    if st:
        _raise_winner("arg_scatter", st, bad[0], arg, rowptr, col, n_out)
    return out


def _csc_args(colptr, row_t, perm, weight, g, n_out):
    """The checks arg_gather and mask_gather share: the CSC transpose and the edge weights."""
    colptr = check_tensor(colptr, "colptr", dtypes=(torch.int64,), dim=1).contiguous()
    row_t = _idx(row_t, "row_t")
    perm = check_tensor(perm, "perm", dtypes=(torch.int64,), dim=1).contiguous()
    if colptr.numel() != n_out + 1:
        raise ValueError(f"colptr must have n_out + 1 = {n_out + 1} entries, got {colptr.numel()}")
    nnz = row_t.numel()
    if perm.numel() != nnz:
        raise ValueError(f"perm must have one entry per nonzero ({nnz}), got {perm.numel()}")
    if weight is not None:
        weight = _feat(weight, "weight", dim=1)
        if weight.numel() != nnz or weight.dtype != g.dtype:
            raise ValueError("weight must have one entry per nonzero and grad's dtype")
    if int(colptr[-1]) != nnz:
        raise ValueError(f"colptr[-1] = {int(colptr[-1])} must equal the number of nonzeros {nnz}")
    return colptr, row_t, perm, weight


def arg_gather(colptr, row_t, perm, arg, rowptr, g, weight, n_out: int):
    """The max/min spmm gradient of x over the CSC transpose ``(colptr, row_t, perm)`` of the CSR
    ``(rowptr, col)``: ``out[i] = sum_{k in col i, rowptr[r] + arg[r] == perm[k]} weight[perm[k]] * g[r]``
    with ``r = row_t[k]`` — what :func:`arg_scatter` gives with ``col``, without scattered writes
    (see segment_backward_tmpl.h)."""
    arg, g, rowptr = _winners(arg, g, rowptr)
    colptr, row_t, perm, weight = _csc_args(colptr, row_t, perm, weight, g, n_out)
    nnz = row_t.numel()
    dt, ct = FEATURE_DTYPES[g.dtype]
    isuf, ict = INDEX_DTYPES[row_t.dtype]
    out = native.empty(n_out, g.shape[1], dtype=g.dtype)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"arg_gather_{dt}_{isuf}")(_p(colptr, "int64_t *"), n_out, _p(row_t, ict), _p(perm, "int64_t *"), nnz,
                                        _p(arg, "int32_t *"), _p(rowptr, "int64_t *"), _p(g, ct), g.shape[0],
                                        g.shape[1], _p(weight, ct), _p(out, ct), _nthreads(), bad)
    if st == -1 and bad[0] <= -2:
        _raise_index("arg_gather", st, -2 - bad[0], "perm", perm, nnz)
    if st:
        _raise_index("arg_gather", st, bad[0], "row_t", row_t, g.shape[0], colptr)
    return out


def arg_weight_grad(arg, g, x, rowptr, col):
    """``w = zeros(nnz); w[e] += x[col[e], j] * g[r, j]`` for each winner ``e = rowptr[r] + arg[r, j]``."""
    arg, g, rowptr = _winners(arg, g, rowptr)
    x = _feat(x, "x")
    col = _idx(col, "col")
    if x.dtype != g.dtype or x.shape[1] != g.shape[1]:
        raise ValueError(f"x must be (n, F) with grad's F and dtype; got {tuple(x.shape)} {x.dtype}")
    if col.numel() != int(rowptr[-1]):
        raise ValueError(f"col must have rowptr[-1] = {int(rowptr[-1])} entries, got {col.numel()}")
    dt, ct = FEATURE_DTYPES[g.dtype]
    isuf, ict = INDEX_DTYPES[col.dtype]
    out = torch.empty(col.numel(), dtype=g.dtype)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"arg_weight_grad_{dt}_{isuf}")(_p(arg, "int32_t *"), g.shape[0], g.shape[1], _p(g, ct), _p(x, ct),
                                             x.shape[0], _p(rowptr, "int64_t *"), _p(col, ict), _p(out, ct),
                                             _nthreads(), bad)
    if st:
        _raise_winner("arg_weight_grad", st, bad[0], arg, rowptr, col, x.shape[0])
    return out


def _check_mask(wmask, nnz, F):
    wmask = check_tensor(wmask, "wmask", dtypes=(torch.int64,), dim=2).contiguous()
    if tuple(wmask.shape) != (nnz, mask_words(F)):
        raise ValueError(f"wmask must have shape (nnz, ceil(F / 64)) = {(nnz, mask_words(F))}, got {tuple(wmask.shape)}")
    return wmask


def _raise_mask(kernel, st, F):
    if st == -2:
        raise ValueError(f"{kernel}: wmask has a bit set at or past F = {F} (not a winner mask of {F} features)")


def mask_gather(colptr, row_t, perm, wmask, g, weight, n_out: int):
    """The max/min spmm gradient of x from the winner mask: ``out[i] = sum_{k in col i, bit j of
    wmask[perm[k]]} weight[perm[k]] * g[row_t[k], j]`` over the CSC transpose ``(colptr, row_t, perm)``."""
    g = _feat(g, "grad")
    colptr, row_t, perm, weight = _csc_args(colptr, row_t, perm, weight, g, n_out)
    nnz = row_t.numel()
    wmask = _check_mask(wmask, nnz, g.shape[1])
    dt, ct = FEATURE_DTYPES[g.dtype]
    isuf, ict = INDEX_DTYPES[row_t.dtype]
    out = native.empty(n_out, g.shape[1], dtype=g.dtype)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"mask_gather_{dt}_{isuf}")(_p(colptr, "int64_t *"), n_out, _p(row_t, ict), _p(perm, "int64_t *"), nnz,
                                         _p(wmask, "uint64_t *"), _p(g, ct), g.shape[0], g.shape[1], _p(weight, ct),
                                         _p(out, ct), _nthreads(), bad)
    _raise_mask("mask_gather", st, g.shape[1])
    if st == -1 and bad[0] <= -2:
        _raise_index("mask_gather", st, -2 - bad[0], "perm", perm, nnz)
    if st:
        _raise_index("mask_gather", st, bad[0], "row_t", row_t, g.shape[0], colptr)
    return out


def mask_gather_proj(colptr, row_t, perm, wmask, g, wl, n_out: int, out=None):
    """:func:`mask_gather` of ``g @ wl`` without that product (float32): ``out[i] = sum_{k in col i,
    bit j of wmask[perm[k]]} (g[row_t[k]] @ wl)[j]``, each in-edge computing the row of ``g @ wl`` it
    needs where it won a feature. ``g`` (n x C) is a max/min-aggregating layer's output gradient and
    ``wl`` (C x F) the linear map after the aggregation (nn.Linear's weight, (out, in)). ``out``: a
    contiguous float32 (n_out x F) tensor to add into (it is returned), else a new one."""
    g = check_tensor(g, "grad", dtypes=(torch.float32,), dim=2).contiguous()
    wl = check_tensor(wl, "wl", dtypes=(torch.float32,), dim=2).contiguous()
    if wl.shape[0] != g.shape[1]:
        raise ValueError(f"wl must have grad's {g.shape[1]} columns as its rows, got shape {tuple(wl.shape)}")
    F = wl.shape[1]
    colptr, row_t, perm, _ = _csc_args(colptr, row_t, perm, None, g, n_out)
    nnz = row_t.numel()
    wmask = _check_mask(wmask, nnz, F)
    if out is not None:
        check_tensor(out, "out", dtypes=(torch.float32,), dim=2)
        if tuple(out.shape) != (n_out, F) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous ({n_out}, {F}) float32 tensor, got {tuple(out.shape)}")
    acc = out is not None
    out = out if acc else native.empty(n_out, F, dtype=torch.float32)
    isuf, ict = INDEX_DTYPES[row_t.dtype]
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"mask_gather_proj_f32_{isuf}")(_p(colptr, "int64_t *"), n_out, _p(row_t, ict), _p(perm, "int64_t *"),
                                            nnz, _p(wmask, "uint64_t *"), _p(g, "float *"), g.shape[0], g.shape[1],
                                            _p(wl, "float *"), F, _p(out, "float *"), int(acc), _nthreads(), bad)
    _raise_mask("mask_gather_proj", st, F)
    if st == -1 and bad[0] <= -2:
        _raise_index("mask_gather_proj", st, -2 - bad[0], "perm", perm, nnz)
    if st:
        _raise_index("mask_gather_proj", st, bad[0], "row_t", row_t, g.shape[0], colptr)
    return out


def mask_weight_grad(wmask, g, x, rowptr, col):
    """``w[e] = sum_{bit j of wmask[e]} x[col[e], j] * g[row(e), j]``: the max/min spmm gradient of
    the edge weights from the winner mask."""
    g = _feat(g, "grad")
    x = _feat(x, "x")
    col = _idx(col, "col")
    rowptr = _check_rowptr(rowptr)
    if rowptr.numel() != g.shape[0] + 1:
        raise ValueError(f"rowptr must have one entry per row of grad plus one ({g.shape[0] + 1}), "
                         f"got {rowptr.numel()}")
    if x.dtype != g.dtype or x.shape[1] != g.shape[1]:
        raise ValueError(f"x must be (n, F) with grad's F and dtype; got {tuple(x.shape)} {x.dtype}")
    if col.numel() != int(rowptr[-1]):
        raise ValueError(f"col must have rowptr[-1] = {int(rowptr[-1])} entries, got {col.numel()}")
    wmask = _check_mask(wmask, col.numel(), g.shape[1])
    dt, ct = FEATURE_DTYPES[g.dtype]
    isuf, ict = INDEX_DTYPES[col.dtype]
    out = torch.empty(col.numel(), dtype=g.dtype)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"mask_weight_grad_{dt}_{isuf}")(_p(wmask, "uint64_t *"), _p(rowptr, "int64_t *"), g.shape[0], _p(col, ict),
                                              _p(x, ct), x.shape[0], _p(g, ct), g.shape[1], _p(out, ct),
                                              _nthreads(), bad)
    _raise_mask("mask_weight_grad", st, g.shape[1])
    if st:
        _raise_index("mask_weight_grad", st, bad[0], "col", col, x.shape[0], rowptr)
    return out


# ----------------------------------------------------------------------------- index structures

def index_to_csr(index, dim_size: int):
    """A scatter index -> (rowptr over dim_size rows, stable sorting permutation), both int64."""
    index = _idx(index, "index")
    if not isinstance(dim_size, int) or dim_size < 0:
        raise ValueError(f"dim_size must be a non-negative int, got {dim_size!r}")
    native.check_allocation((dim_size + 1) * 8, f"index_to_csr: dim_size={dim_size} (a row pointer of {dim_size + 1} int64)")
    isuf, ict = INDEX_DTYPES[index.dtype]
    rowptr = torch.empty(dim_size + 1, dtype=torch.int64)
    perm = torch.empty(index.numel(), dtype=torch.int64)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"index_to_csr_{isuf}")(_p(index, ict), index.numel(), dim_size, _p(rowptr, "int64_t *"),
                                     _p(perm, "int64_t *"), _nthreads(), bad)
    if st:
        _raise_index("index_to_csr", st, bad[0], "index", index, dim_size)
    return rowptr, perm


def csr_transpose(rowptr, col, n_cols: int):
    """CSR (rowptr, col) -> CSC (colptr, row_t, perm), perm[p] = CSR position of CSC entry p."""
    rowptr = _check_rowptr(rowptr)
    col = _idx(col, "col")
    if int(rowptr[-1]) != col.numel():
        raise ValueError(f"rowptr[-1] = {int(rowptr[-1])} must equal col.numel() = {col.numel()}")
    isuf, ict = INDEX_DTYPES[col.dtype]
    native.check_allocation((n_cols + 1) * 8, f"csr_transpose: n_cols={n_cols}")
    colptr = torch.empty(n_cols + 1, dtype=torch.int64)
    row_t = torch.empty(col.numel(), dtype=torch.int64)
    perm = torch.empty(col.numel(), dtype=torch.int64)
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"csr_transpose_{isuf}")(_p(rowptr, "int64_t *"), rowptr.numel() - 1, _p(col, ict), n_cols,
                                      _p(colptr, "int64_t *"), _p(row_t, "int64_t *"), _p(perm, "int64_t *"),
                                      _nthreads(), bad)
    if st:
        _raise_index("csr_transpose", st, bad[0], "col", col, n_cols, rowptr)
    return colptr, row_t, perm


# ----------------------------------------------------------------------------- gather

def gather_rows(src, index, out=None):
    """``out[i] = src[index[i]]`` along dim 0 for any dtype, into ``out`` when given."""
    check_tensor(src, "src")
    if src.dim() < 1:
        raise ValueError("src must have at least one dimension")
    src = src.contiguous()
    index = _idx(index, "index")
    shape = (index.numel(),) + tuple(src.shape[1:])
    if out is None:
        out = native.empty(shape, dtype=src.dtype)
    else:
        check_tensor(out, "out")
        if tuple(out.shape) != shape or out.dtype != src.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {src.dtype} tensor of shape {shape}, "
                             f"got {out.dtype} {tuple(out.shape)}")
        for what, t in (("src", src), ("index", index)):
            if overlaps(out, t):  # rows would be overwritten before they are read
                raise ValueError(f"gather: out shares memory with {what}; pass a separate buffer")
    isuf, ict = INDEX_DTYPES[index.dtype]
    row_bytes = src.element_size() * (src[0].numel() if src.shape[0] else int(torch.Size(src.shape[1:]).numel()))
    bad = native.ffi().new("int64_t *", -1)
    st = _fn(f"gather_rows_bytes_{isuf}")(_p(src, "void *"), src.shape[0], row_bytes, _p(index, ict),
                                          index.numel(), _p(out, "void *"), _nthreads(), bad)
    if st:
        _raise_index("gather", st, bad[0], "index", index, src.shape[0])
    return out


# ----------------------------------------------------------------------------- sampling

SAMPLE_STRATEGIES = {"uniform": 0, "last": 1}
TIME_DTYPES = {torch.int64: ("i64", "int64_t *"), torch.float64: ("f64", "double *")}


def _take_owned(ptr, n: int) -> torch.Tensor:
    """An int64 tensor over ``n`` values the kernel malloc'ed, without a copy: the tensor keeps the
    buffer alive, which frees it (co_free) when the tensor goes."""
    ffi, lib = native.ffi(), native.lib()
    if ptr == ffi.NULL:
        return torch.empty(0, dtype=torch.int64)
    owned = ffi.gc(ptr, lib.co_free)
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(ffi.buffer(owned, n * 8), dtype=torch.int64)


def neighbor_sample(rowptr, col, seeds, fanouts: list, *, replace: bool, directed: bool, disjoint: bool,
                    node_time=None, edge_time=None, seed_time=None, strategy: str = "uniform", rng_seed: int = 0):
    """Uniform k-hop neighbour sampling over the CSR ``(rowptr, col)`` (native/kernels/sample.c).

    Arguments are expected checked by :func:`cpu_opt.gnn.sampling.neighbor_sample` (dtypes:
    rowptr, col, seeds int64; times all int64 or all float64). Returns ``(node, batch, row, col,
    edge, nodes_per_hop, edges_per_hop)``: batch is None unless ``disjoint``. A bad index raises
    (IndexError for col, ValueError for rowptr and duplicate seeds) before any output exists."""
    rowptr = check_tensor(rowptr, "rowptr", dtypes=(torch.int64,), dim=1).contiguous()
    col = check_tensor(col, "col", dtypes=(torch.int64,), dim=1).contiguous()
    seeds = check_tensor(seeds, "seeds", dtypes=(torch.int64,), dim=1).contiguous()
    times = [t for t in (node_time, edge_time, seed_time) if t is not None]
    tdt = times[0].dtype if times else torch.int64
    if tdt not in TIME_DTYPES or any(t.dtype != tdt for t in times):
        raise TypeError(f"node_time, edge_time and seed_time must all be int64 or all float64, got "
                        f"{[str(t.dtype) for t in times]}")
    tsuf, tct = TIME_DTYPES[tdt]
    node_time, edge_time, seed_time = (None if t is None else check_tensor(t, name, dim=1).contiguous()
                                       for t, name in ((node_time, "node_time"), (edge_time, "edge_time"),
                                                       (seed_time, "seed_time")))
    ffi = native.ffi()
    n_nodes = rowptr.numel() - 1
    n_hops = len(fanouts)
    fan = torch.tensor(list(fanouts) or [0], dtype=torch.int64)
    outs = [ffi.new("int64_t **") for _ in range(5)]
    counts = ffi.new("int64_t[2]")
    nph = ffi.new("int64_t[]", n_hops + 1)
    eph = ffi.new("int64_t[]", max(1, n_hops))
    bad = ffi.new("int64_t *", -1)
    st = _fn(f"neighbor_sample_{tsuf}")(
        _p(rowptr, "int64_t *"), n_nodes, _p(col, "int64_t *"), col.numel(), _p(seeds, "int64_t *"), seeds.numel(),
        _p(fan, "int64_t *"), n_hops, int(bool(replace)), int(bool(directed)), int(bool(disjoint)),
        _p(node_time, tct), _p(edge_time, tct), _p(seed_time, tct), SAMPLE_STRATEGIES[strategy],
        int(rng_seed) & 0xFFFFFFFFFFFFFFFF, *outs, counts, nph, eph, _nthreads(), bad)
    if st:
        b = bad[0]
        if st == -1 and b <= -2:
            e = -2 - b
            raise IndexError(f"neighbor_sample: col[{e}] = {int(col[e])} is out of range [0, {n_nodes})")
        if st == -1:
            raise ValueError(f"neighbor_sample: seeds[{b}] = {int(seeds[b])} is out of range [0, {n_nodes})")
        if st == -3:
            lo = int(rowptr[b]) if 0 <= b <= n_nodes else "?"
            hi = int(rowptr[b + 1]) if 0 <= b < n_nodes else "?"
            raise ValueError(f"neighbor_sample: rowptr is not a CSR row pointer over {col.numel()} nonzeros: row {b} "
                             f"spans rowptr[{b}] = {lo} .. rowptr[{b + 1}] = {hi} (rowptr must start at 0, never "
                             f"decrease and end at col.numel())")
        if st == -4:
            raise ValueError(f"neighbor_sample: seeds[{b}] = {int(seeds[b])} occurs twice; seeds must be unique "
                             "unless disjoint=True (one subgraph per seed)")
        if st == -5:
            raise MemoryError("neighbor_sample: out of memory for the sampled subgraph")
        native.check(st, "neighbor_sample", f"bad_pos={b}")
    n_out, e_out = counts[0], counts[1]
    node, batch, row, colo, edge = (_take_owned(o[0], n) for o, n in zip(outs, (n_out, n_out, e_out, e_out, e_out)))
    return (node, batch if disjoint else None, row, colo, edge, [nph[h] for h in range(n_hops + 1)],
            [eph[h] for h in range(n_hops)])


# ----------------------------------------------------------------------------- attention

# the arrays the attention kernels name in bad[1] (native/kernels/attention.c)
_ATT_ARGS = ("rowptr", "col", "colptr", "row_t", "perm")


def _att_csr(rowptr, col):
    rowptr = _check_rowptr(rowptr)
    col = _idx(col, "col")
    if int(rowptr[-1]) != col.numel():
        raise ValueError(f"rowptr[-1] = {int(rowptr[-1])} must equal the number of edges col.numel() = {col.numel()}")
    return rowptr, col


def _att_csc(colptr, row_t, perm, n_src: int, nnz: int):
    colptr = check_tensor(colptr, "colptr", dtypes=(torch.int64,), dim=1).contiguous()
    row_t = _idx(row_t, "row_t").to(torch.int64)
    perm = check_tensor(perm, "perm", dtypes=(torch.int64,), dim=1).contiguous()
    if colptr.numel() != n_src + 1:
        raise ValueError(f"colptr must have one entry per source node plus one ({n_src + 1}), got {colptr.numel()}")
    if row_t.numel() != nnz or perm.numel() != nnz:
        raise ValueError(f"row_t and perm must have one entry per edge ({nnz}), got {row_t.numel()} and {perm.numel()}")
    return colptr, row_t, perm


def _att_nodes(t, name: str, rows: int, H: int, C: int, dtype):
    """A (rows, H, C) node tensor of the feature dtype ``dtype``, contiguous."""
    t = _feat(t, name, dim=3)
    if tuple(t.shape) != (rows, H, C):
        raise ValueError(f"{name} must have shape (num_nodes, heads, channels) = {(rows, H, C)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} dtype {t.dtype} must match the features' dtype {dtype}")
    return t


def _att_per_head(t, name: str, rows: int, H: int, dtype, *, optional: bool = False):
    """A (rows, H) tensor (per node or per edge and head), or None when optional."""
    if t is None and optional:
        return None
    t = _feat(t, name, dim=2)
    if tuple(t.shape) != (rows, H):
        raise ValueError(f"{name} must have shape {(rows, H)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} dtype {t.dtype} must match the features' dtype {dtype}")
    return t


def _att_features(t, name: str):
    t = _feat(t, name, dim=3)
    if t.shape[1] < 1 or t.shape[2] < 1:
        raise ValueError(f"{name} must have at least one head and one channel, got shape {tuple(t.shape)}")
    return t


def _att_raise(kernel: str, st: int, bad, sizes: dict, tensors: dict):
    """The kernel's status as an exception naming the array (sizes: the bound of each index array)."""
    if st == 0:
        return
    which = _ATT_ARGS[bad[1]] if 0 <= bad[1] < len(_ATT_ARGS) else "?"
    pos = bad[0]
    t = tensors.get(which)
    val = int(t[pos]) if t is not None and 0 <= pos < t.numel() else "?"
    if st == -1:
        raise IndexError(f"{kernel}: {which}[{pos}] = {val} is out of range [0, {sizes.get(which, '?')})")
    if st == -3:
        raise ValueError(f"{kernel}: {which} must start at 0, never decrease and end at the number of edges; "
                         f"{which}[{pos}] = {val} breaks that")
    if st == -5:
        raise MemoryError(f"{kernel}: out of memory for the kernel's scratch")
    native.check(st, kernel)


def _att_forward(kind: str, rowptr, col, n_src: int, H: int, C: int, dtype, tensors: list, mask, scalar):
    """Calls ``<kind>_forward``: returns (out, alpha)."""
    n_dst = rowptr.numel() - 1
    nnz = col.numel()
    mask = _att_per_head(mask, "mask", nnz, H, dtype, optional=True)
    dt, ct = FEATURE_DTYPES[dtype]
    isuf, ict = INDEX_DTYPES[col.dtype]
    out = native.empty(n_dst, H, C, dtype=dtype)
    alpha = native.empty(nnz, H, dtype=dtype)
    bad = native.ffi().new("int64_t[2]", [-1, -1])
    st = _fn(f"{kind}_forward_{dt}_{isuf}")(_p(rowptr, "int64_t *"), n_dst, _p(col, ict), n_src, H, C,
                                           *[_p(t, ct) for t in tensors], _p(mask, ct), float(scalar),
                                           _p(out, ct), _p(alpha, ct), _nthreads(), bad)
    _att_raise(f"{kind}_forward", st, bad, {"col": n_src}, {"rowptr": rowptr, "col": col})
    return out, alpha


def _att_backward(kind: str, rowptr, col, colptr, row_t, perm, n_src: int, H: int, C: int, dtype, tensors: list,
                  mask, scalar, alpha, g, grads: list):
    """Calls ``<kind>_backward`` with the gradient buffers ``grads`` (None: not wanted)."""
    n_dst = rowptr.numel() - 1
    nnz = col.numel()
    colptr, row_t, perm = _att_csc(colptr, row_t, perm, n_src, nnz)
    mask = _att_per_head(mask, "mask", nnz, H, dtype, optional=True)
    alpha = _att_per_head(alpha, "alpha", nnz, H, dtype)
    g = _att_nodes(g, "grad_out", n_dst, H, C, dtype)
    dt, ct = FEATURE_DTYPES[dtype]
    isuf, ict = INDEX_DTYPES[col.dtype]
    bad = native.ffi().new("int64_t[2]", [-1, -1])
    st = _fn(f"{kind}_backward_{dt}_{isuf}")(
        _p(rowptr, "int64_t *"), n_dst, _p(col, ict), _p(colptr, "int64_t *"), _p(row_t, "int64_t *"),
        _p(perm, "int64_t *"), n_src, H, C, *[_p(t, ct) for t in tensors], _p(mask, ct), float(scalar),
        _p(alpha, ct), _p(g, ct), *[_p(t, ct) for t in grads], _nthreads(), bad)
    _att_raise(f"{kind}_backward", st, bad, {"col": n_src, "row_t": n_dst, "perm": nnz},
               {"rowptr": rowptr, "col": col, "colptr": colptr, "row_t": row_t, "perm": perm})
    return grads


def _slope(negative_slope) -> float:
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, (int, float)):
        raise TypeError(f"negative_slope must be a float, got {type(negative_slope).__name__}")
    return float(negative_slope)


def _maybe(want: bool, shape, dtype):
    return native.empty(*shape, dtype=dtype) if want else None


def gat_forward(rowptr, col, x, a_src, a_dst, a_edge=None, mask=None, negative_slope: float = 0.2):
    """GATConv's attention and aggregation (native/kernels/attention.c): ``x`` (n_src, H, C) source
    features, ``a_src`` (n_src, H) / ``a_dst`` (n_dst, H) the per-node logits, ``a_edge`` (E, H) an
    optional per-edge logit, ``mask`` (E, H) optional dropout multipliers; all edge tensors in CSR
    order. Returns ``(out (n_dst, H, C), alpha (E, H))``."""
    rowptr, col = _att_csr(rowptr, col)
    x = _att_features(x, "x")
    n_src, H, C = x.shape
    n_dst, nnz = rowptr.numel() - 1, col.numel()
    a_src = _att_per_head(a_src, "a_src", n_src, H, x.dtype)
    a_dst = _att_per_head(a_dst, "a_dst", n_dst, H, x.dtype)
    a_edge = _att_per_head(a_edge, "a_edge", nnz, H, x.dtype, optional=True)
    return _att_forward("gat", rowptr, col, n_src, H, C, x.dtype, [x, a_src, a_dst, a_edge], mask,
                        _slope(negative_slope))


def gat_backward(rowptr, col, colptr, row_t, perm, x, a_src, a_dst, a_edge, mask, negative_slope, alpha, g,
                 needs=(True, True, True, True)):
    """Gradients of :func:`gat_forward` wrt (x, a_src, a_dst, a_edge), None where ``needs`` is False."""
    rowptr, col = _att_csr(rowptr, col)
    x = _att_features(x, "x")
    n_src, H, C = x.shape
    n_dst, nnz = rowptr.numel() - 1, col.numel()
    a_src = _att_per_head(a_src, "a_src", n_src, H, x.dtype)
    a_dst = _att_per_head(a_dst, "a_dst", n_dst, H, x.dtype)
    a_edge = _att_per_head(a_edge, "a_edge", nnz, H, x.dtype, optional=True)
    grads = [_maybe(needs[0], (n_src, H, C), x.dtype), _maybe(needs[1], (n_src, H), x.dtype),
             _maybe(needs[2], (n_dst, H), x.dtype), _maybe(needs[3] and a_edge is not None, (nnz, H), x.dtype)]
    return _att_backward("gat", rowptr, col, colptr, row_t, perm, n_src, H, C, x.dtype, [x, a_src, a_dst, a_edge],
                         mask, _slope(negative_slope), alpha, g, grads)


def _gatv2_args(rowptr, col, x_l, x_r, att):
    rowptr, col = _att_csr(rowptr, col)
    x_l = _att_features(x_l, "x_l")
    n_src, H, C = x_l.shape
    x_r = _att_nodes(x_r, "x_r", rowptr.numel() - 1, H, C, x_l.dtype)
    check_tensor(att, "att", dtypes=tuple(FEATURE_DTYPES))
    if att.numel() != H * C or att.dtype != x_l.dtype:
        raise ValueError(f"att must hold heads x channels = {H} x {C} values of dtype {x_l.dtype}, "
                         f"got shape {tuple(att.shape)} {att.dtype}")
    return rowptr, col, x_l, x_r, att.contiguous().reshape(H, C)


def gatv2_forward(rowptr, col, x_l, x_r, att, mask=None, negative_slope: float = 0.2):
    """GATv2Conv's attention and aggregation: ``x_l`` (n_src, H, C) source features (also the
    messages), ``x_r`` (n_dst, H, C) target features, ``att`` (H, C). Returns ``(out, alpha)``."""
    rowptr, col, x_l, x_r, att = _gatv2_args(rowptr, col, x_l, x_r, att)
    n_src, H, C = x_l.shape
    return _att_forward("gatv2", rowptr, col, n_src, H, C, x_l.dtype, [x_l, x_r, att], mask, _slope(negative_slope))


def gatv2_backward(rowptr, col, colptr, row_t, perm, x_l, x_r, att, mask, negative_slope, alpha, g,
                   needs=(True, True, True)):
    """Gradients of :func:`gatv2_forward` wrt (x_l, x_r, att), None where ``needs`` is False."""
    rowptr, col, x_l, x_r, att = _gatv2_args(rowptr, col, x_l, x_r, att)
    n_src, H, C = x_l.shape
    grads = [_maybe(needs[0], (n_src, H, C), x_l.dtype), _maybe(needs[1], tuple(x_r.shape), x_l.dtype),
             _maybe(needs[2], (H, C), x_l.dtype)]
    return _att_backward("gatv2", rowptr, col, colptr, row_t, perm, n_src, H, C, x_l.dtype, [x_l, x_r, att], mask,
                         _slope(negative_slope), alpha, g, grads)


def _transformer_args(rowptr, col, q, k, v, score_div):
    rowptr, col = _att_csr(rowptr, col)
    v = _att_features(v, "v")
    n_src, H, C = v.shape
    k = _att_nodes(k, "k", n_src, H, C, v.dtype)
    q = _att_nodes(q, "q", rowptr.numel() - 1, H, C, v.dtype)
    if isinstance(score_div, bool) or not isinstance(score_div, (int, float)) or not score_div > 0:
        raise ValueError(f"score_div must be a positive float, got {score_div!r}")
    return rowptr, col, q, k, v, float(score_div)


def transformer_forward(rowptr, col, q, k, v, mask=None, score_div: float = 1.0):
    """TransformerConv's attention and aggregation: ``q`` (n_dst, H, C), ``k`` and ``v`` (n_src, H, C),
    scores ``<q_i, k_j> / score_div``. Returns ``(out, alpha)``."""
    rowptr, col, q, k, v, score_div = _transformer_args(rowptr, col, q, k, v, score_div)
    n_src, H, C = v.shape
    return _att_forward("transformer", rowptr, col, n_src, H, C, v.dtype, [q, k, v], mask, score_div)


def transformer_backward(rowptr, col, colptr, row_t, perm, q, k, v, mask, score_div, alpha, g,
                         needs=(True, True, True)):
    """Gradients of :func:`transformer_forward` wrt (q, k, v), None where ``needs`` is False."""
    rowptr, col, q, k, v, score_div = _transformer_args(rowptr, col, q, k, v, score_div)
    n_src, H, C = v.shape
    grads = [_maybe(needs[0], tuple(q.shape), v.dtype), _maybe(needs[1], (n_src, H, C), v.dtype),
             _maybe(needs[2], (n_src, H, C), v.dtype)]
    return _att_backward("transformer", rowptr, col, colptr, row_t, perm, n_src, H, C, v.dtype, [q, k, v], mask,
                         score_div, alpha, g, grads)


# ----------------------------------------------------------------------------- random

def bernoulli_mt19937(state: torch.Tensor, n: int, keep_below: int, scale: float, out: torch.Tensor) -> torch.Tensor:
    """``n`` dropout multipliers into ``out`` (float32, contiguous): ``scale`` where torch's MT19937,
    given as the bytes of ``torch.get_rng_state()`` in ``state`` (uint8, advanced in place), keeps,
    else 0. ``keep_below`` = ceil(keep probability * 2^53). The draws torch's own
    ``bernoulli_(p)`` makes from that state (native/kernels/random.c)."""
    check_tensor(state, "state", dtypes=(torch.uint8,), dim=1)
    check_tensor(out, "out", dtypes=(torch.float32,))
    if not state.is_contiguous() or not out.is_contiguous():
        raise ValueError("bernoulli_mt19937: state and out must be contiguous")
    if n < 0 or out.numel() < n:
        raise ValueError(f"bernoulli_mt19937: n = {n} must be in [0, out.numel() = {out.numel()}]")
    if not 0 <= keep_below <= 1 << 53:
        raise ValueError(f"bernoulli_mt19937: keep_below = {keep_below} must be in [0, 2^53]")
    st = _fn("bernoulli_mt19937_f32")(_p(state, "void *"), state.numel(), n, keep_below, scale, _p(out, "float *"))
    if st:
        raise ValueError(f"bernoulli_mt19937: the generator state is not torch's MT19937 layout "
                         f"({state.numel()} bytes, status {st})")
    return out
