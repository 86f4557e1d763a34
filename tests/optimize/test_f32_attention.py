"""cpu_opt's fused float32 attention (``native/kernels/f32_attention.c``,
:func:`cpu_opt.backends.attention.f32_attention`), the ``attention``/``fp32`` route on CPUs that run
the avx2 and avx512 variants: numbers against a float64 reference at float32 precision (and next to torch's
SDPA's own error), causal and grouped heads, fully masked rows, what it leaves to torch, bounds
checks on every operand, the status outside its variant, and its calls inside float32 Hugging Face
models (counted, so a test cannot pass through torch's kernel)."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import cpu_opt
from cpu_opt import native
from cpu_opt.backends import attention as battn
from cpu_opt.errors import NativeKernelError
from cpu_opt.platform import hw, routing

pytestmark = pytest.mark.isa


def _runs_here() -> bool:
    return native.select_variant(hw.detect()) in ("avx2", "avx512")


@pytest.fixture
def sdpa_calls(monkeypatch):
    """How often the float32 kernel's caller fell back to torch's SDPA."""
    calls = []
    real = battn._torch_sdpa

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(battn, "_torch_sdpa", spy)
    return calls


def _reference(q, k, v, mask=None, is_causal=False, gqa=False, scale=None):
    if mask is not None and mask.is_floating_point():
        mask = mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, is_causal=is_causal, enable_gqa=gqa,
                                          scale=scale)


def _rel(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _qkv(B, H, Sq, Sk, D, Dv, seed, Hk=None):
    """q as the strided head view of a fused projection's output (BERT's layout), k and v as head
    views of (batch, seq, heads, dim) tensors (row strides Hk * D and Hk * Dv), v's rows padded
    further (row stride Hk * Dv + 8) so that no kernel can take its width for its row stride."""
    g = torch.Generator().manual_seed(seed)
    Hk = Hk or H
    fused = torch.randn(B, Sq, H * D + 8, generator=g)
    q = fused[..., 8:].view(B, Sq, H, D).transpose(1, 2)
    k = torch.randn(B, Sk, Hk, D, generator=g).transpose(1, 2)
    v = torch.randn(B, Sk, Hk * Dv + 8, generator=g)[..., :Hk * Dv].view(B, Sk, Hk, Dv).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("B,H,Sq,Sk,D,Dv", [(1, 12, 128, 128, 64, 64), (1, 12, 197, 197, 64, 64), (2, 3, 37, 37, 64, 64),
                                            (1, 2, 5, 70, 40, 24), (3, 4, 16, 16, 128, 128), (1, 1, 1, 1, 64, 64),
                                            (2, 2, 33, 129, 7, 80)])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "full", "bool", "per_head"])
def test_f32_attention_matches_the_float64_reference(B, H, Sq, Sk, D, Dv, mask_kind, sdpa_calls):
    q, k, v = _qkv(B, H, Sq, Sk, D, Dv, seed=B * 100 + Sq + Sk)
    g = torch.Generator().manual_seed(7)
    mask = {"none": None,
            "padding": torch.zeros(B, 1, 1, Sk).masked_fill(torch.arange(Sk) >= max(1, Sk - 3), float("-inf")),
            "full": torch.randn(B, 1, Sq, Sk, generator=g),
            "bool": torch.rand(B, 1, Sq, Sk, generator=g) > 0.3,
            "per_head": torch.randn(B, H, Sq, Sk, generator=g)}[mask_kind]
    if mask_kind == "bool":
        mask[..., 0] = True   # no row entirely masked
    out = battn.f32_attention(q, k, v, mask)
    ref = _reference(q, k, v, mask)
    assert out.dtype == torch.float32 and out.shape == (B, H, Sq, Dv)
    torch_err = _rel(F.scaled_dot_product_attention(q, k, v, mask), ref)
    err = _rel(out, ref)
    assert err < max(4 * torch_err, 2e-6), (err, torch_err)   # float32 rounding, as torch's own kernel
    if _runs_here():
        assert not sdpa_calls, "the fused float32 kernel should have run"
        # written in the (batch, seq, heads, dim) layout the output projection reads
        assert out.transpose(1, 2).is_contiguous()
    else:
        assert sdpa_calls, "without a vector variant the attention is torch's SDPA"


@pytest.mark.parametrize("Sq,Sk,H,Hk", [(37, 37, 4, 4), (5, 70, 4, 2), (128, 128, 12, 12), (24, 24, 8, 2), (1, 9, 2, 1),
                                        (200, 200, 2, 1), (40, 9, 2, 2)])
def test_f32_attention_takes_causal_and_grouped_heads(Sq, Sk, H, Hk, sdpa_calls):
    q, k, v = _qkv(2, H, Sq, Sk, 64, 64, seed=Sq * 7 + Hk, Hk=Hk)
    for is_causal in (True, False):
        out = battn.f32_attention(q, k, v, None, is_causal=is_causal, enable_gqa=Hk != H, scale=0.2)
        ref = _reference(q, k, v, is_causal=is_causal, gqa=Hk != H, scale=0.2)
        assert _rel(out, ref) < 2e-6, (is_causal, _rel(out, ref))
    assert not sdpa_calls if _runs_here() else sdpa_calls


def test_f32_attention_fully_masked_rows_are_zero_and_the_rest_goes_to_torch(sdpa_calls):
    q, k, v = _qkv(1, 2, 8, 8, 64, 64, seed=3)
    mask = torch.zeros(1, 1, 8, 8)
    mask[:, :, 2] = float("-inf")
    out = battn.f32_attention(q, k, v, mask)
    if _runs_here():
        assert not sdpa_calls
        assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
        assert torch.isfinite(out).all()
    # what the kernel does not take runs torch's SDPA, with its answers
    n = len(sdpa_calls)
    battn.f32_attention(q, k, v, mask, is_causal=True)   # both: torch's own error or answer decides
    battn.f32_attention(q[0], k[0], v[0])   # rank 3
    bf = battn.f32_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())   # not float32
    assert bf.dtype == torch.bfloat16
    battn.f32_attention(q, k, v, dropout_p=0.5)
    assert len(sdpa_calls) == n + 4
    # no keys, or an empty head: torch's answers, not an error
    for a, b, c in ((q, k[:, :, :0], v[:, :, :0]), (q[..., :0], k[..., :0], v)):
        assert torch.equal(battn.f32_attention(a, b, c), F.scaled_dot_product_attention(a, b, c))


def test_f32_attention_kernel_checks_every_operand_bound():
    if not _runs_here():
        pytest.skip("the kernel's bounds checks run in the avx2 and avx512 variants; elsewhere it returns CO_ERR_UNSUPPORTED_AMX "
                    "before reading anything (asserted below)")
    q, k, v = (torch.randn(1, 2, 16, 64) for _ in range(3))
    out = torch.empty(1, 2, 16, 64)
    f = native.ffi()
    fn = native.kernel("f32_attention")
    st = f.new("int64_t[15]", [2048, 1024, 64] * 4 + [0, 0, 16])
    mask = torch.zeros(1, 1, 16, 16)
    p = (lambda t: f.cast("float *", t.data_ptr()))

    def call(q_len=2048, k_len=2048, v_len=2048, out_len=2048, m_len=256, nk=16, hk=2, scale=0.125):
        return fn(p(q), q_len, st, p(k), k_len, st + 3, p(v), v_len, st + 6, 1, 2, hk, 16, nk, 64, 64, scale, 0,
                  p(mask), m_len, st + 12, p(out), out_len, st + 9, 2)

    assert call() == 0
    out.fill_(7.0)
    for bad in ({"q_len": 2047}, {"k_len": 100}, {"v_len": 0}, {"out_len": 2000}, {"m_len": 255}):
        assert call(**bad) == -1, bad    # CO_ERR_INDEX_OUT_OF_RANGE, nothing read or written
    assert torch.all(out == 7.0)
    assert call(nk=16385) == -2          # more keys than the kernel takes
    assert call(hk=0) == -2 and call(hk=3) == -2   # kv heads that do not divide the query heads
    assert call(scale=float("nan")) == -2
    assert call(hk=1, k_len=1024, v_len=1024) == 0   # one kv head reaches half as far
    assert call(hk=1, k_len=1023) == -1
    with pytest.raises(NativeKernelError, match="CO_ERR_INDEX_OUT_OF_RANGE"):
        native.check(call(q_len=10), "f32_attention")


def test_f32_attention_refuses_outside_its_variant():
    f = native.ffi()
    st = f.new("int64_t[3]", [0, 0, 0])
    for variant in native.compiled_variants():
        if variant not in ("avx2", "avx512"):
            assert native.kernel("f32_attention", variant)(f.NULL, 0, st, f.NULL, 0, st, f.NULL, 0, st, 1, 1, 1, 1, 1,
                                                            64, 64, 1.0, 0, f.NULL, 0, f.NULL, f.NULL, 0, st, 1) == -6



@pytest.mark.parametrize("name", ["bert", "gpt2_lm_head", "vit"])
def test_f32_attention_runs_in_float32_hf_models(name, monkeypatch):
    """float32 Hugging Face models: where the fp32 attention route is the fused kernel its calls are
    counted (BERT's padding mask, GPT-2's causal mask, ViT's unmasked attention) and the outputs stay
    within 1e-4 relative of eager at two shapes; elsewhere the graph holds no call of it."""
    pytest.importorskip("transformers")
    from optimize_testutil import count_fused_attention_calls
    from test_hf_models import CASES, SHAPES, _at_two_shapes, _max_rel

    calls = count_fused_attention_calls(monkeypatch, "_f32_kernel")
    # these small configurations have 16-24 queries, under the AVX-512 rule's 48 (its bound is tested in
    # test_f32_attention_route_is_chosen_per_node_by_its_query_count): the kernel is asked for from one
    monkeypatch.setattr(routing, "RULES", tuple(
        dataclasses.replace(r, min_rows=1) if (r.work, r.dtype, r.backend) == ("attention", "fp32", "f32_fused") else r
        for r in routing.RULES))
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    opt = cpu_opt.optimize(model, inputs(*SHAPES["first"]), dtype="fp32")
    rep = opt.report()
    assert rep["validation"]["ok"] and "fell_back" not in rep["validation"]
    plan = next(iter(opt._plans.values()))
    routed = [n for n in plan.program.graph.nodes if n.op == "call_function" and n.target is battn.f32_attention]
    calls.clear()
    for shape, out, ref in _at_two_shapes(model, inputs, opt):
        assert _max_rel(out, ref) < 1e-4, (name, shape)
    if routing.route("attention", "fp32").backend == "f32_fused" and _runs_here():
        assert len(routed) == 2   # two layers
        assert len(calls) >= 4 and {c[1:] for c in calls} == {(4, 4)}, calls
    else:
        assert not routed and not calls


def test_f32_attention_scale_default_is_torchs():
    q, k, v = _qkv(1, 2, 9, 9, 48, 48, seed=1)
    out = battn.f32_attention(q, k, v)
    assert _rel(out, _reference(q, k, v, scale=1 / math.sqrt(48))) < 2e-6


class _SelfAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v) + 1


@pytest.mark.parametrize("queries", [1, 12, 40, 64])
def test_f32_attention_route_is_chosen_per_node_by_its_query_count(queries):
    """The pass routes each SDPA node by the query count its graph fixes: a decoder's one-token step
    (1 query) goes where the table's rule for one row says (torch's kernel on AVX2 and AVX-512, where
    the fused call costs more than the work), longer ones to the fused kernel where it runs; the
    report says so."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, queries, 32), torch.randn(1, 4, 48, 32), torch.randn(1, 4, 48, 32))
    model = _SelfAttention().eval()
    opt = cpu_opt.optimize(model, (q, k, v), dtype="fp32")
    plan = next(iter(opt._plans.values()))
    routed = [n for n in plan.program.graph.nodes if n.op == "call_function" and n.target is battn.f32_attention]
    want = routing.route("attention", "fp32", rows=queries).backend == "f32_fused" and _runs_here()
    assert len(routed) == int(want)
    first = {"avx2": 12, "avx512": 48}.get(native.select_variant(hw.detect()))  # the rules' min_rows
    if first is not None:
        assert want == (queries >= first)
    torch.testing.assert_close(opt(q, k, v), model(q, k, v), rtol=1e-5, atol=1e-5)
