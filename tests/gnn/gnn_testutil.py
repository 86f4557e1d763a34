"""Helpers shared by tests/gnn (imported by name: conftest.py puts this folder on sys.path,
since the suite runs with --import-mode=importlib)."""
import torch

from cpu_opt import hw, native

# Variants that can execute here, whatever the cap (avx512 cannot on an AVX2-only CPU:
# test_segment checks that it was at least compiled).
RUNNABLE_VARIANTS = [v for v in reversed(native.VARIANT_ORDER)
                     if v in native.compiled_variants() and native.VARIANT_REQUIRES[v] <= hw.detect().isa_uncapped]


def make_graph(case: str, seed: int = 0):
    """(n_rows, n_cols, dst, src): edges src -> dst, rows are destinations."""
    g = torch.Generator().manual_seed(seed)
    if case == "random":                 # unsorted, with duplicates and empty rows by chance
        n = 40
        e = 160
        return n, n, torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
    if case == "isolated":               # nodes 12..29 have no edges at all (empty rows, unused cols)
        n = 30
        return n, n, torch.randint(0, 12, (60,), generator=g), torch.randint(0, 12, (60,), generator=g)
    if case == "duplicates":             # every edge three times, shuffled
        n = 15
        d, s = torch.randint(0, n, (20,), generator=g), torch.randint(0, n, (20,), generator=g)
        p = torch.randperm(60, generator=g)
        return n, n, d.repeat(3)[p], s.repeat(3)[p]
    if case == "single_node":
        return 1, 1, torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    if case == "single_node_no_edges":
        return 1, 1, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    if case == "no_edges":
        return 10, 10, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    if case == "sorted":                 # destinations already sorted
        n = 25
        d = torch.randint(0, n, (80,), generator=g).sort().values
        return n, n, d, torch.randint(0, n, (80,), generator=g)
    if case == "bipartite":              # 20 targets, 35 sources
        return 20, 35, torch.randint(0, 20, (90,), generator=g), torch.randint(0, 35, (90,), generator=g)
    if case == "hub":                    # power-law-ish: one row holds most edges
        n = 50
        d = torch.where(torch.rand(200, generator=g) < 0.7, torch.tensor(3), torch.randint(0, n, (200,), generator=g))
        return n, n, d, torch.randint(0, n, (200,), generator=g)
    raise ValueError(case)


GRAPH_CASES = ["random", "isolated", "duplicates", "single_node", "single_node_no_edges", "no_edges",
               "sorted", "bipartite", "hub"]


def ref_spmm(n_rows, dst, src, x, reduce, weight=None):
    """torch reference: one message per edge (duplicates kept), reduced at dst; empty rows 0."""
    msg = x.index_select(0, src)
    if weight is not None:
        msg = msg * weight.unsqueeze(1)
    out = torch.zeros(n_rows, x.shape[1], dtype=x.dtype)
    return out.scatter_reduce(0, dst.unsqueeze(1).expand_as(msg), msg, reduce, include_self=False)


def assert_bf16_close(out, ref):
    """bf16 tolerance: within 2^-7 relative (+1e-2 absolute) of the fp32 reference computed from
    the same bf16 inputs, and cosine similarity >= 0.999."""
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-2)
    a, b = out.float().flatten(), ref.float().flatten()
    if a.norm() > 0 and b.norm() > 0:
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.999



def csr_case(case: str, index_dtype=torch.int64):
    """A GRAPH_CASES graph as a CSRGraph: (graph, n_rows, n_cols, dst, src, perm), where perm is
    the stable sort of dst (CSR position i holds edge perm[i])."""
    from cpu_opt import gnn
    from cpu_opt.gnn import _kernels as K

    n_rows, n_cols, dst, src = make_graph(case)
    rowptr, perm = K.index_to_csr(dst, n_rows)
    return gnn.CSRGraph(rowptr, src[perm].to(index_dtype), n_cols), n_rows, n_cols, dst, src, perm
