"""Canonical forms (passes/canonical.py) and the tanh GELU on cpu_opt's native kernel (fp32) or oneDNN
eltwise primitive (passes.route_gelu, backends/native_eltwise, backends/onednn_primitives.OnednnEltwise): exact rewrites, checked against eager,
on hand-written modules and on Hugging Face GPT-2 (whose NewGELU and Conv1D they are for)."""
import math

import pytest
import torch
import transformers
from torch import nn

import cpu_opt
import optimize_testutil
from cpu_opt.backends.onednn_primitives import OnednnEltwise
from cpu_opt.compiler import passes
from cpu_opt.compiler.capture import capture

aten = torch.ops.aten


class NewGELU(nn.Module):
    """GPT-2's activation, written out as transformers writes it; ``variant`` reorders operands."""

    def __init__(self, variant=0):
        super().__init__()
        self.variant = variant

    def forward(self, x):
        c = math.sqrt(2.0 / math.pi)
        if self.variant == 0:
            return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))
        return (1.0 + torch.tanh((0.044715 * torch.pow(x, 3.0) + x) * c)) * (x * 0.5)


class Conv1DBlock(nn.Module):
    """GPT-2's MLP: addmm on 2-D views of the activations (Conv1D), viewed back to 3-D, the NewGELU,
    the projection, and the residual add after the view."""

    def __init__(self, d=32, h=96, variant=0):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(d, h) / 6), nn.Parameter(torch.randn(h))
        self.w2, self.b2 = nn.Parameter(torch.randn(h, d) / 10), nn.Parameter(torch.randn(d))
        self.act = NewGELU(variant)

    def forward(self, x):
        b, s, d = x.shape
        h = torch.addmm(self.b1, x.view(-1, d), self.w1).view(b, s, -1)
        h = self.act(h)
        y = torch.addmm(self.b2, h.view(-1, h.shape[-1]), self.w2).view(b, s, d)
        return y + x


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("variant", [0, 1])
def test_written_out_tanh_gelu_becomes_one_gelu_and_residual_add_follows_the_gemm(variant):
    m = Conv1DBlock(variant=variant).eval()
    x = torch.randn(2, 8, 32)
    gm = capture(m, x).gm
    log = passes.run_passes(gm)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    gelus = [n for n in gm.graph.nodes if n.target == aten.gelu.default]
    assert len(gelus) == 1 and gelus[0].kwargs == {"approximate": "tanh"}
    assert aten.tanh.default not in ops and aten.pow.Tensor_Scalar not in ops
    adds = [n for n in gm.graph.nodes if n.target == aten.add.Tensor]
    assert len(adds) == 1 and adds[0].args[0].target == aten.addmm.default     # the add right after the GEMM
    assert any("tanh GELU" in line for line in log) and any("residual add" in line for line in log)
    with torch.no_grad():
        assert _rel(gm(x)[0], m(x)) < 1e-5


def test_a_tanh_like_chain_with_other_constants_is_left_alone():
    class Almost(nn.Module):
        def forward(self, x):
            return 0.5 * x * (1.0 + torch.tanh(0.7 * (x + 0.044715 * torch.pow(x, 3.0))))

    gm = capture(Almost(), torch.randn(4, 8)).gm
    passes.run_passes(gm)
    assert not any(n.target == aten.gelu.default for n in gm.graph.nodes)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tanh_gelu_runs_on_the_native_kernel_or_the_onednn_eltwise_primitive(dtype):
    """fp32: cpu_opt's vectorized tanh GELU where the vector kernels run; bf16: the oneDNN primitive
    (or, with AMX, the GEMM's post-op); in place on the GEMM's fresh output either way."""
    from cpu_opt.backends import native_eltwise

    m = Conv1DBlock().eval()
    x = torch.randn(2, 16, 32)
    opt = cpu_opt.optimize(m, x, dtype=dtype)
    with torch.no_grad():
        ref = m(x)
        y = opt(x)
    assert _rel(y, ref) < (1e-5 if dtype == "fp32" else 2e-2)
    prog = next(iter(opt._plans.values())).program
    elt = [n.target for n in prog.graph.nodes if isinstance(n.target, OnednnEltwise)]
    from cpu_opt.compiler.passes.eltwise import _eltwise_runs

    runs = _eltwise_runs(torch.float32 if dtype == "fp32" else torch.bfloat16)   # bf16 needs avx512_core
    from cpu_opt import routing
    from cpu_opt.backends.torch_onednn import TORCH_LINEAR, bf16_linear_runs

    fused = [n for n in prog.graph.nodes if n.target is TORCH_LINEAR and n.args[3:] == ("gelu", [], "tanh")]
    if dtype == "bf16" and bf16_linear_runs() and routing.route("linear", "bf16", rows=32).backend == "torch_onednn":
        assert len(fused) == 1 and not elt        # with AMX: the GEMM takes it as its post-op (through the view)
    elif dtype == "fp32" and native_eltwise.available():
        nat = [n.target for n in prog.graph.nodes if n.target in (native_eltwise.gelu_tanh, native_eltwise.gelu_tanh_)]
        assert nat == [native_eltwise.gelu_tanh_] and not elt   # in place: the GEMM's fresh output, read once
    elif optimize_testutil.onednn_graph_used(dtype) and runs:
        assert len(elt) == 1 and elt[0].kind == "gelu_tanh"
        assert elt[0].in_place                     # the GEMM's fresh output, read by nothing else
    y2 = opt(torch.randn(2, 16, 32))
    assert _rel(y, ref) < (1e-5 if dtype == "fp32" else 2e-2)    # the first answer is untouched
    del y2


class ReadTwice(nn.Module):
    def forward(self, x):
        h = x * 2.0
        return torch.nn.functional.gelu(h, approximate="tanh"), h[:, :3]


def test_tanh_gelu_is_not_in_place_where_its_input_is_read_again():
    m = ReadTwice().eval()
    x = torch.randn(4, 8)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    g, h = opt(x)
    rg, rh = m(x)
    assert _rel(g, rg) < 1e-5 and torch.equal(h, rh)
    prog = next(iter(opt._plans.values())).program
    assert not any(isinstance(n.target, OnednnEltwise) and n.target.in_place for n in prog.graph.nodes)
    from cpu_opt.backends import native_eltwise

    assert not any(n.target is native_eltwise.gelu_tanh_ for n in prog.graph.nodes)


def test_hf_gpt2_newgelu_and_conv1d_residuals_are_canonicalized():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=200, use_cache=False)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 200, (1, 24))
    opt = cpu_opt.optimize(m, {"input_ids": ids}, dtype="fp32")
    log = " ".join(opt.report()["passes"])
    assert "2 tanh GELU(s)" in log, log
    assert "residual add(s) moved" in log, log
    with torch.no_grad():
        assert _rel(opt(input_ids=ids).logits, m(input_ids=ids).logits) < 1e-4


class _Heads(nn.Module):
    """Query, key and value projections of one input, split into heads (a view of the last
    dimension), attention; ``flat`` adds a reader that views a projection with its leading dimensions
    merged, which a slice of a wider GEMM output cannot give."""

    def __init__(self, d=32, heads=4, flat=False):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.heads, self.flat = heads, flat

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        if self.flat:
            a = a + self.v(x).view(b * s, d).view(b, s, d)
        return a


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_parallel_projections_become_one_gemm(dtype):
    """q, k and v read one input: one GEMM over their concatenated weights, sliced; same answers."""
    m = _Heads().eval()
    x = torch.randn(2, 8, 32)
    opt = cpu_opt.optimize(m, x, dtype=dtype)
    log = opt.report()["passes"]
    assert any(line.startswith("1 group(s) of linear layers reading one input") for line in log), log
    tol = 1e-5 if dtype == "fp32" else 3e-2
    assert torch.allclose(opt(x), m(x).detach(), rtol=tol, atol=tol)


def test_projections_read_by_a_leading_dims_view_stay_apart():
    """A second call of v whose output is viewed with its leading dimensions merged stays its own
    GEMM; q, k and the first v merge."""
    gm = capture(_Heads(flat=True).eval(), (torch.randn(2, 8, 32),)).gm
    before = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    log = passes.merge_parallel_linears(gm)
    after = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(before) == 4 and len(after) == 2, log
    apart = [n for n in after if not str(n.args[1].target).startswith("_cpu_opt_qkv")]
    assert len(apart) == 1 and any(u.target == torch.ops.aten.view.default and
                                   tuple(u.meta["val"].shape) == (16, 32) for u in apart[0].users)


class MaskedLayers(nn.Module):
    """Three attention ops reading one boolean padding mask (a BERT encoder's pattern)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(3))

    def forward(self, x, keep):
        b, s, d = x.shape
        mask = keep[:, None, None, :].expand(b, 1, s, s)
        for p in self.qkv:
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in p(x).chunk(3, -1))
            x = x + nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)
        return x


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_shared_boolean_mask_is_made_additive_once(dtype):
    """The boolean mask read by three attention ops becomes one additive mask (0 / -inf in the
    attention's dtype) that all three read: the answer is eager's (torch makes the same tensor
    inside each call), with padded keys and a second padding pattern alike."""
    from cpu_opt.backends.attention import additive_mask

    torch.manual_seed(0)
    m = MaskedLayers().eval()
    x = torch.randn(2, 8, 32)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[1, 5:] = False
    opt = cpu_opt.optimize(m, (x, keep), dtype=dtype)
    plan = next(iter(opt._plans.values()))
    made = [n for n in plan.program.graph.nodes if n.op == "call_function" and n.target is additive_mask]
    assert len(made) == 1 and len(made[0].users) == 3
    # the dtype the routed kernel adds it in: float32 scores on the fp32 routes, on bf16
    # matmul -> softmax -> matmul and cpu_opt's fused kernel (bf16 without AMX), bf16 for torch's bf16
    # flash kernel (with AMX)
    from cpu_opt.backends.attention import bf16_matmul_softmax_attention, dpbf16_attention_bf16
    routed = {u.target for u in made[0].users}
    assert len(routed) == 1
    want = torch.bfloat16 if dtype == "bf16" and not routed & {bf16_matmul_softmax_attention, dpbf16_attention_bf16} \
        else torch.float32
    assert made[0].args[1] == want
    assert any("boolean attention mask" in line for line in opt.report()["passes"])
    tol = 1e-5 if dtype == "fp32" else 3e-2
    keep2 = keep.clone()
    keep2[0, 2:] = False
    with torch.no_grad():
        for kp in (keep, keep2):
            ref = m(x, kp)
            assert ((opt(x, kp) - ref).abs().max() / ref.abs().max()).item() < tol
    with pytest.raises(TypeError, match="boolean mask"):
        additive_mask(torch.zeros(2, 2), torch.float32)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_matmul_softmax_attention_zeroes_rows_that_attend_to_nothing(mask_kind):
    """The matmul -> softmax -> matmul route (bf16 without AMX) gives torch's SDPA answers, also for
    a query row whose every key is masked (left padding under a causal mask: HF GPT-2 and Llama with a
    padded batch): SDPA returns zeros there, a plain softmax NaN, which made HF GPT-2 in bf16 fail its
    validation on a Zen 4 and fall back to torch."""
    from cpu_opt.backends.attention import additive_mask, bf16_matmul_softmax_attention, matmul_softmax_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    keep = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    keep[0, :, :, :3] = False  # row 0's first three queries see no key
    mask = keep if mask_kind == "bool" else additive_mask(keep, torch.float32)
    ref = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    out = matmul_softmax_attention(q, k, v, mask)
    assert torch.isfinite(out).all() and (out[0, :, :3] == 0).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out16 = bf16_matmul_softmax_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert torch.isfinite(out16).all() and (out16[0, :, :3] == 0).all()
    torch.testing.assert_close(out16.float(), ref, rtol=3e-2, atol=3e-2)
    # no dead row: the probabilities are not touched, the answer is SDPA's
    full = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    torch.testing.assert_close(matmul_softmax_attention(q, k, v, full),
                               nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full), rtol=1e-5, atol=1e-5)
