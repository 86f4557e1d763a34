"""The native kernels around an int8 transformer's GEMMs: the fused attention, on AMX tiles
(``native/kernels/amx_attention.c``, :func:`cpu_opt.backends.attention.amx_attention`) or on
AVX512_BF16 dot products (``native/kernels/dpbf16_attention.c``,
:func:`cpu_opt.backends.attention.dpbf16_attention`), and the LayerNorm that writes its int8 consumers' uint8 input (``native/kernels/layer_norm.c``,
:class:`cpu_opt.backends.native_norm.LayerNormU8`): numbers against float references, what happens
where the CPU lacks the kernel's instructions (torch's kernel runs, and the test says which ran), bad input, and their
place in an int8 Hugging Face BERT."""
import math

import pytest
import torch

import cpu_opt
from cpu_opt import native
from cpu_opt.backends import attention as battn
from cpu_opt.backends import native_norm
from cpu_opt.errors import NativeKernelError
from cpu_opt.platform import hw

from .quant_testutil import compare, gen

MIN_COSINE = 0.99   # the int8 accuracy bar (as in test_int8_models)

pytestmark = [pytest.mark.isa, pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")]


def _amx_here() -> bool:
    return _runs_here("amx")


# the two fused attention kernels: (Python entry point, C kernel, the ISA features it needs)
KERNELS = {"amx": ("amx_attention", "amx_attention_bf16", ("amx_bf16", "amx_tile")),
           "dpbf16": ("dpbf16_attention", "dpbf16_attention", ("avx512_bf16",))}


def _runs_here(kernel: str) -> bool:
    info = hw.detect()
    return all(info.has(f) for f in KERNELS[kernel][2]) and native.select_variant(info) == "avx512"


def _attention(kernel: str):
    return getattr(battn, KERNELS[kernel][0])


def _reference(q, k, v, mask, scale):
    """float64 scores, the exponentials rounded to bf16 before p @ v and normalised after (what the
    kernel computes; torch's bf16 flash kernel does the same up to its own rounding)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + (torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
                 if mask.dtype == torch.bool else mask.double())
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e.float().bfloat16().double() @ v.double()) / e.sum(-1, keepdim=True)


def _qkv(B, H, Sq, Sk, D, Dv, seed):
    """q as the strided head view of a fused projection's output (as in BERT), k and v as views of
    (batch, seq, heads, dim) tensors."""
    g = gen(seed)
    fused = torch.randn(B, Sq, H * D + 24, generator=g).bfloat16()
    q = fused[..., 8:8 + H * D].view(B, Sq, H, D).transpose(1, 2)
    k = torch.randn(B, Sk, H, D, generator=g).bfloat16().transpose(1, 2)
    v = torch.randn(B, Sk, H, Dv, generator=g).bfloat16().transpose(1, 2)
    return q, k, v


@pytest.fixture
def flash_calls(monkeypatch):
    """How often the attention fell back to torch's bf16 flash kernel."""
    calls = []
    real = battn.bf16_flash_attention

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(battn, "bf16_flash_attention", spy)
    return calls


MASKS = ("none", "padding", "full", "bool")


@pytest.mark.parametrize("B,H,Sq,Sk,D,Dv", [(1, 12, 128, 128, 64, 64), (2, 3, 37, 37, 64, 64), (1, 2, 5, 70, 40, 24),
                                            (3, 4, 16, 16, 128, 128), (1, 1, 1, 1, 64, 64), (2, 2, 33, 129, 96, 80)])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_fused_attention_matches_the_reference(kernel, B, H, Sq, Sk, D, Dv, mask_kind, flash_calls):
    q, k, v = _qkv(B, H, Sq, Sk, D, Dv, seed=B * 100 + Sq + Sk)
    g = gen(7)
    mask = {"none": None,
            "padding": torch.zeros(B, 1, 1, Sk).masked_fill(torch.arange(Sk) >= max(1, Sk - 3), float("-inf")),
            "full": torch.randn(B, 1, Sq, Sk, generator=g),
            "bool": torch.rand(B, 1, Sq, Sk, generator=g) > 0.3}[mask_kind]
    if mask_kind == "bool":
        mask[..., 0] = True   # no row entirely masked (torch's kernel gives NaN there)
    scale = 1.0 / math.sqrt(D)
    out = _attention(kernel)(q, k, v, mask, scale=scale)
    ref = _reference(q, k, v, mask, scale)
    assert out.dtype == torch.float32 and out.shape == (B, H, Sq, Dv)
    err = (out.double() - ref).abs().max().item()
    if _runs_here(kernel):
        assert not flash_calls, f"the {kernel} kernel should have run"
        # written in the (batch, seq, heads, dim) layout the output projection reads as (batch, seq, heads * dim)
        assert out.transpose(1, 2).is_contiguous()
        assert err < 2e-3, err        # bf16 rounding of the exponentials, whose ties may differ
    else:
        assert flash_calls, f"without the {kernel} kernel's instructions the attention is torch's bf16 flash kernel"
        assert err < 5e-2, err


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_fused_attention_fully_masked_rows_are_zero_and_other_calls_go_to_torch(kernel, flash_calls):
    attention = _attention(kernel)
    q, k, v = _qkv(1, 2, 8, 8, 64, 64, seed=3)
    mask = torch.zeros(1, 1, 8, 8)
    mask[:, :, 2] = float("-inf")
    out = attention(q, k, v, mask)
    if _runs_here(kernel):
        assert not flash_calls
        assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
        assert torch.isfinite(out).all()
    n = len(flash_calls)
    # what the kernel does not take runs torch's flash kernel, with the same answers: the AMX kernel
    # takes no causal flag or grouped heads (the AVX512_BF16 one does: the next test)
    if kernel == "amx":
        attention(q, k, v, None, is_causal=True)
        # grouped heads: 2 query heads on 1 kv head (with as many kv heads as query heads, enable_gqa
        # changes nothing and the kernel takes the call)
        grouped = attention(q, k[:, :1], v[:, :1], None, dropout_p=0.0, enable_gqa=True)
        ref = _reference(q, k[:, :1].expand_as(k), v[:, :1].expand_as(v), None, 1 / 8)
        assert (grouped.double() - ref).abs().max() < 5e-2
        n += 2
        attention(q, k, v, None, enable_gqa=True)
        assert len(flash_calls) == n + (0 if _runs_here(kernel) else 1)
        n = len(flash_calls)
    attention(q, k, v, mask, is_causal=True)   # both: torch's own error or answer decides
    attention(q[0], k[0], v[0])   # rank 3
    assert len(flash_calls) == n + 2


@pytest.mark.parametrize("Sq,Sk,H,Hk", [(37, 37, 4, 4), (5, 70, 4, 2), (128, 128, 12, 12), (24, 24, 8, 2), (1, 9, 2, 1)])
def test_dpbf16_attention_takes_causal_and_grouped_heads(Sq, Sk, H, Hk, flash_calls):
    """The AVX512_BF16 kernel's own extras: torch's is_causal (query i sees keys j <= i, the keys
    past a block skipped) and grouped query heads (enable_gqa: H / Hk query heads per kv head, each
    kv head packed once), against the float64 reference."""
    g = gen(Sq * 7 + Hk)
    q = torch.randn(2, H, Sq, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, Hk, Sk, 64, generator=g).bfloat16() for _ in range(2))
    causal = torch.ones(Sq, Sk, dtype=torch.bool).tril()
    for is_causal in (True, False):
        out = battn.dpbf16_attention(q, k, v, None, is_causal=is_causal, enable_gqa=Hk != H)
        kr, vr = (t.repeat_interleave(H // Hk, dim=1) for t in (k, v))
        ref = _reference(q, kr, vr, causal if is_causal else None, 1 / 8)
        err = (out.double() - ref).abs().max().item()
        if _runs_here("dpbf16"):
            assert not flash_calls and err < 2e-3, err
        else:
            assert flash_calls and err < 5e-2, err
    # the bf16 graph's entry point: the same numbers in bf16, its fallback matmul -> softmax -> matmul
    out16 = battn.dpbf16_attention_bf16(q, k, v, None, is_causal=True, enable_gqa=Hk != H)
    assert out16.dtype == torch.bfloat16
    assert (out16.double() - _reference(q, kr, vr, causal, 1 / 8)).abs().max() < 3e-2


@pytest.mark.parametrize("Sq,Sk,H,Hk,D,Dv", [(128, 128, 12, 12, 64, 64), (37, 70, 4, 2, 64, 40), (5, 9, 2, 1, 32, 80),
                                          (13, 13, 3, 3, 17, 5)])
def test_dpbf16_bf16_output_is_the_float32_output_rounded(Sq, Sk, H, Hk, D, Dv, monkeypatch):
    """The bf16 graph's entry point writes bf16 from the kernel itself (dpbf16_attention_bf16out): bit for bit
    the float32 kernel's output rounded to nearest even by torch, on whole and partial 12-row blocks,
    output widths below, above and not a multiple of 32, grouped heads, causal, a mask, the output in
    the projection's layout; NaN from v stays NaN. Its matmul-softmax fallback must not run."""
    if not _runs_here("dpbf16"):
        pytest.skip("the kernel runs on AVX512_BF16 CPUs (elsewhere the bf16 entry point's fallback is tested above)")

    def no_fallback(*a, **kw):
        raise AssertionError("the bf16 entry point fell back to matmul-softmax")

    monkeypatch.setattr(battn, "bf16_matmul_softmax_attention", no_fallback)
    g = gen(Sq * 3 + Dv)
    q = torch.randn(2, H, Sq, D, generator=g).bfloat16()
    k = torch.randn(2, Hk, Sk, D, generator=g).bfloat16()
    v = torch.randn(2, Hk, Sk, Dv, generator=g).bfloat16()
    v[1, 0, 2, 3] = float("nan")
    mask = torch.where(torch.rand(2, 1, Sq, Sk, generator=g) < 0.2, -1e4, 0.0)
    for is_causal, m in ((False, mask), (True, None)):
        ref = battn.dpbf16_attention(q, k, v, m, is_causal=is_causal, enable_gqa=Hk != H)
        out = battn.dpbf16_attention_bf16(q, k, v, m, is_causal=is_causal, enable_gqa=Hk != H)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape and out.stride() == ref.stride()
        nan = ref.isnan()
        assert nan.any() and torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan].view(torch.int16), ref.to(torch.bfloat16)[~nan].view(torch.int16))
    # the native entry point's own bound on its bf16 output (in bf16 elements)
    f = native.ffi()
    fn = native.kernel("dpbf16_attention_bf16out")
    qs, ks = (f.new("int64_t[3]", [t.stride(0), t.stride(1), t.stride(2)]) for t in (q, k))
    o = torch.empty(2, H, Sq, Dv, dtype=torch.bfloat16)
    os_ = f.new("int64_t[3]", list(o.stride()[:3]))
    u16 = lambda t: f.cast("uint16_t *", t.data_ptr())  # noqa: E731

    def call(out_len):
        return fn(u16(q), q.numel(), qs, u16(k), k.numel(), ks, u16(v), v.numel(), f.new("int64_t[3]", list(v.stride()[:3])),
                  2, H, Hk, Sq, Sk, D, Dv, 0.125, 0, f.NULL, 0, f.NULL, u16(o), out_len, os_, 2)

    assert call(o.numel()) == 0
    assert call(o.numel() - 1) == -1   # CO_ERR_INDEX_OUT_OF_RANGE, nothing written past the output
    assert fn(u16(q), q.numel(), qs, u16(k), k.numel(), ks, u16(v), v.numel(), f.new("int64_t[3]", list(v.stride()[:3])),
              2, H, Hk, Sq, Sk, D, Dv, 0.125, 0, f.NULL, 0, f.NULL, f.NULL, o.numel(), os_, 2) == -2


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_fused_attention_kernel_checks_every_operand_bound(kernel):
    if not _runs_here(kernel):
        pytest.skip(f"the {kernel} kernel's bounds checks run where its instructions do; elsewhere it returns "
                    "CO_ERR_UNSUPPORTED_AMX before reading anything (asserted below)")
    q, k, v = (torch.randn(1, 2, 16, 64).bfloat16() for _ in range(3))
    out = torch.empty(1, 2, 16, 64)
    f = native.ffi()
    fn = native.kernel(KERNELS[kernel][1])
    st = f.new("int64_t[15]", [2048, 1024, 64] * 4 + [0, 0, 16])
    mask = torch.zeros(1, 1, 16, 16)
    u16, f32 = (lambda t: f.cast("uint16_t *", t.data_ptr())), (lambda t: f.cast("float *", t.data_ptr()))

    def call(q_len=2048, k_len=2048, v_len=2048, out_len=2048, m_len=256, nk=16, hk=2):
        heads, scaling = ((1, 2, hk), (0.125, 0)) if kernel == "dpbf16" else ((1, 2), (0.125,))
        return fn(u16(q), q_len, st, u16(k), k_len, st + 3, u16(v), v_len, st + 6, *heads, 16, nk, 64, 64, *scaling,
                  f32(mask), m_len, st + 12, f32(out), out_len, st + 9, 2)

    assert call() == 0
    for bad in ({"q_len": 2047}, {"k_len": 100}, {"v_len": 0}, {"out_len": 2000}, {"m_len": 255}):
        assert call(**bad) == -1, bad    # CO_ERR_INDEX_OUT_OF_RANGE, nothing read or written
    assert call(nk=16385) == -2          # more keys than the kernel takes
    if kernel == "dpbf16":
        assert call(hk=0) == -2 and call(hk=3) == -2   # kv heads that do not divide the query heads
        assert call(hk=1, k_len=1024, v_len=1024) == 0   # one kv head reaches half as far
        assert call(hk=1, k_len=1023) == -1
    with pytest.raises(NativeKernelError, match="CO_ERR_INDEX_OUT_OF_RANGE"):
        native.check(call(q_len=10), KERNELS[kernel][1])


def test_fused_attention_kernels_refuse_without_their_variant():
    """Outside the avx512 variant the kernel does nothing and says so; the Python side then runs
    torch's kernel (asserted in the tests above on a CPU without AMX)."""
    f = native.ffi()
    for variant in native.compiled_variants():
        if variant == "avx512":
            continue
        st = f.new("int64_t[3]", [0, 0, 0])
        assert native.kernel("amx_attention_bf16", variant)(f.NULL, 0, st, f.NULL, 0, st, f.NULL, 0, st, 1, 1, 1, 1,
                                                             64, 64, 1.0, f.NULL, 0, f.NULL, f.NULL, 0, st, 1) == -6
        assert native.kernel("dpbf16_attention", variant)(f.NULL, 0, st, f.NULL, 0, st, f.NULL, 0, st, 1, 1, 1, 1, 1,
                                                           64, 64, 1.0, 0, f.NULL, 0, f.NULL, f.NULL, 0, st, 1) == -6


# ------------------------------------------------------------------------------- LayerNorm -> uint8
@pytest.mark.parametrize("rows,cols,affine", [(128, 768, True), (7, 33, True), (3, 5, False), (1, 1, True),
                                              (64, 1024, False)])
@pytest.mark.parametrize("qmax", [255, 127])
def test_layer_norm_u8_matches_torch_then_quantize(rows, cols, affine, qmax):
    g = gen(rows * 31 + cols)
    x = torch.randn(2, rows, cols, generator=g) * 3 + 1
    w = torch.randn(cols, generator=g) * 0.2 + 1 if affine else None
    b = torch.randn(cols, generator=g) * 0.1 if affine else None
    scale, zp = 0.02, min(120, qmax)
    y, q = native_norm.layer_norm_u8(x, [cols], w, b, 1e-5, scale, zp, qmax=qmax)
    ref = torch.nn.functional.layer_norm(x.double(), [cols], None if w is None else w.double(),
                                         None if b is None else b.double(), 1e-5)
    assert y.shape == x.shape and q.shape == x.shape and q.dtype == torch.uint8
    assert (y.double() - ref).abs().max() < 2e-5
    ln = torch.nn.functional.layer_norm(x, [cols], w, b, 1e-5)
    rq = torch.quantize_per_tensor(ln, scale, zp, torch.quint8).int_repr().to(torch.int).clamp(max=qmax)
    diff = (q.to(torch.int) - rq).abs()
    # the same bytes as torch's layer_norm + quantize_per_tensor, but where the two norms differ in the
    # last float bit at a rounding boundary (off by one there)
    assert diff.max() <= 1 and diff.float().mean() < 1e-3
    assert q.max() <= qmax
    fn = native_norm.LayerNormU8(cols, 1e-5, scale, zp, qmax, want_float=False)
    assert torch.equal(fn(x.contiguous(), w, b), q)


def test_layer_norm_u8_keeps_a_large_offset_out_of_the_variance():
    x = 1e4 + torch.randn(4, 256, generator=gen(9)) * 1e-2
    y, _ = native_norm.layer_norm_u8(x, [256], None, None, 1e-12, 0.05, 128)
    ref = torch.nn.functional.layer_norm(x.double(), [256], eps=1e-12)
    assert (y.double() - ref).abs().max() < 2e-3   # torch's own float32 layer_norm: about 1e-3 here


def test_layer_norm_u8_rejects_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="float32"):
        native_norm.layer_norm_u8(x.double(), [8], None, None, 1e-5, 0.1, 0)
    with pytest.raises(ValueError, match="last dimension"):
        native_norm.layer_norm_u8(x, [4], None, None, 1e-5, 0.1, 0)
    with pytest.raises(ValueError, match="last dimension only"):
        native_norm.layer_norm_u8(x, [4, 8], None, None, 1e-5, 0.1, 0)
    with pytest.raises(ValueError, match="scale"):
        native_norm.layer_norm_u8(x, [8], None, None, 1e-5, 0.0, 0)
    with pytest.raises(ValueError, match="zero point"):
        native_norm.layer_norm_u8(x, [8], None, None, 1e-5, 0.1, 200, qmax=127)
    with pytest.raises(ValueError, match="weight"):
        native_norm.layer_norm_u8(x, [8], torch.ones(7), None, 1e-5, 0.1, 0)
    fn = native_norm.LayerNormU8(8, 1e-5, 0.1, 3, 255, want_float=True)
    with pytest.raises(ValueError, match="float32 CPU input"):
        fn(x.half(), None, None)
    # a strided input (the graph pass cannot promise a layout) is read as a dense copy
    strided = torch.randn(8, 4, generator=gen(2)).t()
    y, q = fn(strided, None, None)
    y2, q2 = fn(strided.contiguous(), None, None)
    assert torch.equal(y, y2) and torch.equal(q, q2) and y.is_contiguous()
    with pytest.raises(ValueError, match="bias"):
        fn(x, None, torch.ones(8, dtype=torch.float64))


# ----------------------------------------------------------------------- in an int8 Hugging Face BERT
def test_int8_bert_norms_and_attention(monkeypatch):
    """An int8 HF BERT: every LayerNorm in front of int8 layers writes their uint8 input (one native
    pass) where the vectorized kernel runs, the attention runs cpu_opt's fused kernel where the CPU has
    AMX or AVX512_BF16 (counted), and the answers stay within the int8 accuracy of fp32."""
    T = pytest.importorskip("transformers")
    from cpu_opt.backends.native_norm import LayerNormU8
    from cpu_opt.quant import kernels as K

    torch.manual_seed(0)
    m = T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 vocab_size=100, max_position_embeddings=64)).eval()
    g = gen(11)

    def text(seed):
        ids = torch.randint(0, 100, (2, 24), generator=gen(seed))
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, 19:] = 0
        return {"input_ids": ids, "attention_mask": mask}

    x = text(5)
    calib = [text(100 + i) for i in range(8)]
    ran = []

    def counting(kernel, real):
        def getter():
            fn = real()
            if fn is None:
                return None

            def wrapped(*a):
                ran.append((kernel, *a[9:11]))   # which kernel, B, H
                return fn(*a)
            return wrapped
        return getter

    monkeypatch.setattr(battn, "_amx_kernel", counting("amx", battn._amx_kernel))
    monkeypatch.setattr(battn, "_dpbf16_kernel", counting("dpbf16", battn._dpbf16_kernel))
    opt = cpu_opt.optimize(m, x, dtype="int8", calibration_data=calib)
    nodes = [n for n in opt._base_plan.program.graph.nodes if n.op == "call_function"]
    norms = [n for n in nodes if isinstance(n.target, LayerNormU8)]
    ran.clear()   # (optimize ran the plan too: its first call, validation)
    with torch.no_grad():
        y, ref = opt(**x).last_hidden_state, m(**x).last_hidden_state
        y_again = opt(**x).last_hidden_state
    cos, _ = compare(y, ref)
    assert cos >= MIN_COSINE, cos
    assert torch.equal(y, y_again)
    if native_norm.available():
        # the embeddings' norm and each layer's two norms are read by int8 layers (the last one only
        # through the pooler's select: it stays torch's)
        assert len(norms) == 4, [n.name for n in norms]
        for n in norms:
            readers = [u for u in n.users if isinstance(u.target, K.LinearKernel)] + \
                [u for g_ in n.users for u in g_.users if isinstance(u.target, K.LinearKernel) and u.args[0] is g_
                 and g_.args[1:] == (1,)]
            assert readers, n.name
        assert any("LayerNorm(s) writing the uint8 input" in line for line in opt.report()["passes"])
    else:
        assert not norms
    from cpu_opt.platform import routing

    # the AMX kernel where the CPU has tiles, else the AVX512_BF16 one where it has those dot products
    kernel = "amx" if _amx_here() else "dpbf16" if _runs_here("dpbf16") else None
    if kernel and routing.auto_dtype() == "bf16":
        attention = [n for n in nodes if n.target is _attention(kernel)]
        assert len(attention) == 2 and ran == [(kernel, 2, 4)] * 4, ran   # 2 layers, 2 calls
        label = {"amx": "fused amx_bf16 kernel", "dpbf16": "fused dpbf16 kernel"}[kernel]   # the route's name
        assert any(label in line for line in opt.report()["passes"]), opt.report()["passes"]
    else:
        assert not ran
