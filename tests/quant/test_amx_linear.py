"""cpu_opt/backends/amx_linear.py + native/kernels/amx_qlinear.c — the int8 GEMM on AMX tiles.

Against a float64 reference from the dequantized input and weights, over the shapes that take the
kernel's edge paths: rows that are not a multiple of 16 (the zero-padded tail, a 32-row block that
straddles it), columns that are not a multiple of 16 (masked stores), an input width that is not a
multiple of 64 (the padded copy); every residual kind, activation and output type. The kernel runs
only on a CPU with AMX-INT8; elsewhere (or under an ISA cap below it) these tests check that it is
absent, that routing never picks it, and that building the layer still works while running it raises
a clear error.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_testutil import REF_POST, dequant_w, gen, int8_weights, quantize_ref  # noqa: E402

import cpu_opt  # noqa: E402
from cpu_opt import native  # noqa: E402
from cpu_opt.backends import amx_linear  # noqa: E402
from cpu_opt.backends.amx_linear import AmxLinear, kernel  # noqa: E402
from cpu_opt.errors import NativeKernelError  # noqa: E402
from cpu_opt.platform import hw, routing  # noqa: E402

HAS_AMX = kernel() is not None
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="no AMX-INT8 here: test_kernel_exists_exactly_where_the_cpu_has_amx "
                                                   "and test_without_amx_* cover this CPU")
XS, XZ = 2.0 ** -5, 40


def test_kernel_exists_exactly_where_the_cpu_has_amx():
    info = hw.detect()
    want = {"amx_int8", "amx_tile"} <= info.isa and native.select_variant(info) == "avx512"
    assert HAS_AMX == want


def test_routing_takes_amx_for_up_to_256_rows_on_amx_cpus_only():
    info = hw.detect()
    r128 = routing.route("linear", "int8", info, rows=128, macs=128 * 768 * 3072)
    r512 = routing.route("linear", "int8", info, rows=512, macs=512 * 768 * 3072)
    if {"amx_int8", "amx_tile"} <= info.isa:
        assert r128.backend == "amx" and r512.backend == "onednn"
    else:
        assert "amx" not in (r128.backend, r512.backend)
    # the chooser sends a width that is not a multiple of 64 (or an AMX-less CPU) elsewhere
    from cpu_opt.quant.api import choose_family

    fam, why = choose_family("linear", 128, 10**8, in_features=100)
    assert fam != "amx"
    fam, _ = choose_family("linear", 128, 10**8, in_features=768, post_op="gelu_erf")
    assert (fam == "amx") == (HAS_AMX and r128.backend == "amx")


def test_without_amx_under_an_isa_cap_the_kernel_is_absent_and_the_layer_refused(monkeypatch):
    wq, ws = int8_weights((32, 64), 1)
    built = AmxLinear(wq, ws, None, (XS, XZ)) if HAS_AMX else None
    monkeypatch.setenv("CPU_OPT_MAX_ISA", "avx512_core_vnni")
    assert kernel() is None
    assert not amx_linear.supports(64, None)
    with pytest.raises(RuntimeError, match="no AMX-INT8"):
        AmxLinear(wq, ws, None, (XS, XZ))
    if built is not None:   # built before the cap: its call says so too
        with pytest.raises(RuntimeError, match="no AMX-INT8"):
            built(torch.zeros(4, 64, dtype=torch.uint8))


def _case(m, n, kd, seed):
    wq, ws = int8_weights((n, kd), seed)
    b = torch.randn(n, generator=gen(seed + 1))
    q = torch.randint(0, 256, (m, kd), generator=gen(seed + 2))
    x = (q - XZ).double() * XS
    return wq, ws, b, q.to(torch.uint8), x @ dequant_w(wq, ws).t() + b.double()


def _close(y, ref, rel=2e-5):
    assert y.shape == ref.shape
    err = (y.double() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item() + 1e-6, err


@needs_amx
@pytest.mark.parametrize("m,n,kd", [(1, 16, 64), (15, 40, 64), (16, 100, 128), (17, 48, 768), (33, 32, 192),
                                    (130, 200, 256), (7, 24, 100), (45, 33, 40)])
@pytest.mark.parametrize("post", [None, "relu", "gelu_erf", "gelu_tanh", "silu", "hardswish"], ids=str)
def test_float32_output_matches_float64_reference(m, n, kd, post):
    wq, ws, b, u, ref = _case(m, n, kd, m * 7 + n)
    k = AmxLinear(wq, ws, b, (XS, XZ), post_op=post)
    _close(k(u), REF_POST[post](ref))
    _close(k(u.float().sub(XZ).mul(XS)), REF_POST[post](ref))   # a float input, quantized on the way in


@needs_amx
@pytest.mark.parametrize("m,n,kd", [(5, 40, 64), (48, 64, 768), (130, 100, 100)])
def test_bf16_and_uint8_outputs(m, n, kd):
    wq, ws, b, u, ref = _case(m, n, kd, 3)
    k = AmxLinear(wq, ws, b, (XS, XZ))
    k.write_bf16()
    y = k(u)
    assert y.dtype == torch.bfloat16
    _close(y.float(), ref, rel=2 ** -8)
    lo, hi = float(ref.min()), float(ref.max())
    qs = (hi - lo) / 255
    qp = (qs, int(round(-lo / qs)))
    yq = AmxLinear(wq, ws, b, (XS, XZ), out_qparams=qp)(u)
    assert yq.dtype == torch.uint8
    assert (yq.double() - quantize_ref(ref, *qp)).abs().max().item() <= 1
    # a range half as wide: the values beyond it saturate at 0 / 255, never wrap
    yq2 = AmxLinear(wq, ws, b, (XS, XZ), out_qparams=(qs / 2, qp[1]))(u)
    assert (yq2.double() - quantize_ref(ref, qs / 2, qp[1])).abs().max().item() <= 1
    assert int(yq2.max()) == 255 and int(yq2.min()) == 0


@needs_amx
@pytest.mark.parametrize("kind", ["f32", "u8", "s8"])
def test_residual_added_before_the_activation(kind):
    m, n, kd = 37, 72, 192
    wq, ws, b, u, ref = _case(m, n, kd, 11)
    k = AmxLinear(wq, ws, b, (XS, XZ), post_op="relu")
    if kind == "f32":
        other = torch.randn(m, n, generator=gen(12))
        add = other.double()
    else:
        dt = torch.uint8 if kind == "u8" else torch.int8
        lo, hi = (0, 256) if kind == "u8" else (-128, 128)
        other = torch.randint(lo, hi, (m, n), generator=gen(13)).to(dt)
        k.other_qparams = (0.03, 17 if kind == "u8" else 0)
        add = (other.double() - k.other_qparams[1]) * k.other_qparams[0]
    _close(k(u, other), torch.relu(ref + add))
    if kind == "s8":
        k.other_qparams = (0.03, 5)
        with pytest.raises(RuntimeError, match="symmetric"):
            k(u, other)


@needs_amx
def test_repeated_calls_leave_earlier_outputs_alone():
    # a fresh output per call, also where the runtime allows reusing one (reuse_output: faster here fresh)
    wq, ws, b, u, ref = _case(64, 64, 128, 21)
    k = AmxLinear(wq, ws, b, (XS, XZ))
    for reuse in (False, True):
        k.reuse_output = reuse
        y1 = k(u)
        q2 = torch.randint(0, 256, (64, 128), generator=gen(22))
        ref2 = ((q2 - XZ).double() * XS) @ dequant_w(wq, ws).t() + b.double()
        y2 = k(q2.to(torch.uint8))
        _close(y2, ref2)
        _close(y1, ref)   # unchanged by the second call
        assert y1.data_ptr() != y2.data_ptr()


@needs_amx
def test_native_kernel_checks_its_bounds_and_arguments():
    fn, ffi = kernel(), native.ffi()
    wq, ws = int8_weights((32, 64), 5)
    wp = amx_linear.pack_weights(wq)
    x = torch.zeros(8, 64, dtype=torch.uint8)
    sc, bi = torch.ones(32), torch.zeros(32)
    y = torch.empty(8, 32)

    def call(x_len=x.numel(), wp_len=wp.numel(), out_len=y.numel(), k=64, post=0, out_kind=0, out_zp=0, ldx=64):
        return fn(ffi.cast("uint8_t *", x.data_ptr()), x_len, 8, k, ldx, ffi.cast("int8_t *", wp.data_ptr()), wp_len,
                  32, ffi.cast("float *", sc.data_ptr()), ffi.cast("float *", bi.data_ptr()), ffi.NULL, 0, 0, 0,
                  1.0, 0, post, ffi.cast("void *", y.data_ptr()), out_len, 32, out_kind, 1.0, out_zp, 2)

    assert call() == 0
    oob, bad = -1, -2   # CO_ERR_INDEX_OUT_OF_RANGE, CO_ERR_BAD_ARGUMENT
    assert call(x_len=x.numel() - 1) == oob
    assert call(wp_len=wp.numel() - 1) == oob
    assert call(out_len=y.numel() - 1) == oob
    assert call(k=0) == bad and call(post=6) == bad and call(out_kind=3) == bad
    assert call(out_kind=2, out_zp=256) == bad and call(ldx=63) == bad
    with pytest.raises(NativeKernelError, match="amx_qlinear_u8s8"):
        native.check(call(x_len=3), "amx_qlinear_u8s8")


@needs_amx
def test_hf_bert_int8_linear_layers_run_on_amx_with_merged_bf16_projections():
    """A small `transformers` BERT (widths multiples of 64, 8 x 24 rows) in int8: every linear layer on
    the AMX kernel (the report and the kernel calls say so), query/key/value merged into one GEMM, and
    the answer within the int8 tolerance of eager fp32."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quant_testutil import KernelCalls

    cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                                  vocab_size=500, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 500, (8, 24), generator=gen(1))
    calib = [{"input_ids": torch.randint(0, 500, (8, 24), generator=gen(10 + i))} for i in range(4)]
    opt = cpu_opt.optimize(m, {"input_ids": ids}, dtype="int8", calibration_data=calib)
    rows = opt.report()["int8"]
    lin = [r for r in rows if r["kind"] == "linear"]
    assert lin and all(r["family"] == "amx" for r in lin), [(r["layer"], r["family"]) for r in lin]
    assert any("merged_gemm" in r for r in lin)
    with pytest.MonkeyPatch.context() as mp:
        calls = KernelCalls(mp)
        with torch.no_grad():
            y = opt(input_ids=ids).last_hidden_state
    assert calls.calls.get(("amx", "linear"), 0) >= 2 * 4   # per layer: merged qkv, o, two FFN GEMMs
    with torch.no_grad():
        ref = m(input_ids=ids).last_hidden_state
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0).item()
    assert cos >= 0.99, cos
