"""The oneDNN primitive binding against torch: fp32 to 1e-5 relative, int8 exact, bf16 within
bf16 rounding (on CPUs that have bf16 kernels; elsewhere the binding must say unimplemented)."""
import pytest
import torch
import torch.nn.functional as F

from cpu_opt import dnnl
from cpu_opt.dnnl import primitives as P
from cpu_opt.errors import DnnlError

from cpu_opt import hw
from cpu_opt.dnnl import probe


def vnni() -> bool:
    return hw.has_vnni(hw.detect())


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def test_version_and_library():
    v = dnnl.version()
    assert v.startswith("3."), v
    assert dnnl.version_info()["cpu_runtime"] == "omp"


@pytest.mark.parametrize("M,K,N", [(1, 7, 5), (64, 256, 128), (33, 384, 640)])
@pytest.mark.parametrize("post", [(), ("relu",), ("gelu_erf",), ("gelu_tanh",), ("silu",), ("sigmoid",), ("tanh",), ("hardswish",)])
def test_matmul_fp32_bias_postops(M, K, N, post):
    a, w, b = torch.randn(M, K), torch.randn(K, N), torch.randn(N)
    y = P.Matmul(w, b, post)(a)
    ref = a.double() @ w.double() + b.double()
    acts = {"relu": F.relu, "gelu_erf": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
            "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "hardswish": F.hardswish}
    for p in post:
        ref = acts[p](ref)
    # the matmul itself to 1e-5; oneDNN's vectorised transcendental post-ops add up to ~5e-5
    assert rel(y, ref) < (1e-5 if not post or post == ("relu",) else 1e-4)


def test_matmul_from_linear_3d_input():
    lin = torch.nn.Linear(96, 40)
    x = torch.randn(3, 5, 96)
    y = P.Matmul.from_linear(lin.weight.detach(), lin.bias.detach())(x)
    assert y.shape == (3, 5, 40)
    assert rel(y, lin(x).detach()) < 1e-5


def test_matmul_sum_and_binary_add_postops():
    a, w = torch.randn(16, 32), torch.randn(32, 24)
    res = torch.randn(16, 24)
    out = res.clone()
    P.Matmul(w, post_ops=[P.PostOp("sum"), "relu"])(a, out=out)
    assert rel(out, torch.relu(a @ w + res)) < 1e-5
    row = torch.randn(24)
    y = P.Matmul(w, post_ops=[P.PostOp("add", shape=(1, 24))])(a, binary=[row])
    assert rel(y, a @ w + row) < 1e-5


def test_functional_matmul_batched_and_transposed():
    a, b = torch.randn(2, 3, 8, 16), torch.randn(2, 3, 16, 4)
    assert rel(P.matmul(a, b), a @ b) < 1e-5
    bt = torch.randn(2, 3, 4, 16).transpose(-1, -2)  # strided view, no copy
    assert rel(P.matmul(a, bt), a @ bt) < 1e-5


def test_int8_u8s8_exact_integer_reference():
    # Without VNNI oneDNN's u8 x s8 kernels add pairs of products in int16 with saturation,
    # so exactness holds for 7-bit activations there (as torch's x86 reduce_range qconfig uses).
    hi = 256 if vnni() else 128
    a = torch.randint(0, hi, (37, 200), dtype=torch.uint8)
    w = torch.randint(-128, 128, (200, 65), dtype=torch.int8)
    y = P.Matmul(w, dst_dtype=torch.int32)(a)
    assert y.dtype == torch.int32
    assert torch.equal(y, a.to(torch.int32) @ w.to(torch.int32))


def test_int8_scales_zero_point_relu():
    a = torch.randint(0, 128, (20, 64), dtype=torch.uint8)
    w = torch.randint(-128, 128, (64, 30), dtype=torch.int8)
    ws = torch.rand(30) * 0.02 + 0.001
    y = P.Matmul(w, src_scale=0.05, weight_scales=ws, src_zero_point=64, post_ops=["relu"])(a)
    ref = torch.relu(((a.double() - 64) * 0.05) @ (w.double() * ws.double()))
    assert y.dtype == torch.float32
    assert rel(y, ref) < 1e-5


def test_bf16_matmul_accepted_exactly_from_avx512_core():
    """oneDNN 3.2 accepts bf16 from avx512_core up (emulated without AVX512_BF16) and answers
    dnnl_unimplemented below it: both sides asserted, decided by the features after the cap."""
    info = hw.detect()
    a, w = torch.randn(64, 256).bfloat16(), torch.randn(256, 96).bfloat16()
    impl = probe.matmul_impl("bf16")
    if not hw.has_avx512_core(info):
        assert impl is None and not probe.accepts("bf16") and not probe.native("bf16")
        with pytest.raises(DnnlError, match="dnnl_unimplemented"):
            P.Matmul(w)(a)  # the binding says so, it does not crash
        return
    assert impl is not None and probe.accepts("bf16")
    y = P.Matmul(w)(a)
    ref = (a.float() @ w.float())
    # both round the fp32 accumulation once to bf16: within one bf16 ulp (2^-8 relative)
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all()
    assert rel(y, torch.matmul(a, w)) < 2 ** -7


def test_bf16_native_kernels_exactly_where_the_cpu_has_bf16_math():
    """The implementation string tells native from emulated bf16: native kernels
    (avx512_core_bf16 / AMX) where the CPU has AVX512_BF16 or AMX-BF16 after the cap, and never
    elsewhere (Ice Lake: gemm:jit:bf16, emulated; AVX2: none at all)."""
    info = hw.detect()
    impl = probe.matmul_impl("bf16")
    assert probe.native("bf16") == hw.has_native_bf16(info), (impl, sorted(info.isa))
    if impl is not None and not hw.has_native_bf16(info):
        assert not any(tag in impl for tag in probe.NATIVE_BF16_IMPLS), impl


def test_fp32_and_int8_matmuls_always_created_and_vnni_follows_the_features():
    info = hw.detect()
    assert probe.accepts("fp32") and probe.native("fp32")
    assert probe.accepts("int8")
    impl = probe.matmul_impl("int8")
    if probe.native("int8"):
        assert hw.has_vnni(info), (impl, sorted(info.isa))  # no VNNI kernel without the instructions
    if "avx512_vnni" in info.isa and hw.has_avx512_core(info):
        # seen on the Ice Lake: brg:avx512_core_vnni (shared/KNOWN.md). AVX-VNNI alone (avx2_vnni) is
        # not asserted: whether oneDNN 3.2 has AVX-VNNI int8 matmuls was never checked on such a CPU.
        assert probe.native("int8"), impl
    if not hw.has_vnni(info):
        assert not probe.native("int8"), impl


def test_probe_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="fp8"):
        probe.matmul_impl("fp8")


def test_bf16_graph_refused_with_an_exception_where_onednn_would_abort():
    """oneDNN 3.2's Graph API aborts the process (uncaught C++ dnnl::error) on bf16 eltwise work below
    avx512_core; the binding refuses bf16 logical tensors there, and works where oneDNN takes bf16.
    Run in a fresh process so an abort fails this test instead of killing the suite."""
    import subprocess
    import sys

    code = ("import torch\nfrom cpu_opt.dnnl.graph import Graph\nfrom cpu_opt.errors import DnnlError\n"
            "g = Graph()\ntry:\n    x = g.tensor((4, 8), torch.bfloat16)\nexcept DnnlError as e:\n"
            "    print('REFUSED', e.status)\n    raise SystemExit(0)\n"
            "y = g.tensor((4, 8), torch.bfloat16)\ng.op('ReLU', [x], [y])\n(p,) = g.partitions()\n"
            "out = p.compile()([torch.tensor([[-1.0, 2.0] * 4] * 4).bfloat16()])[0]\n"
            "print('RAN', out.float().min().item(), out.float().max().item())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # 134 would be the abort
    if probe.accepts("bf16"):
        assert "RAN 0.0 2.0" in r.stdout, r.stdout
    else:
        assert "REFUSED dnnl_unimplemented" in r.stdout, r.stdout


def test_inner_product():
    lin = torch.nn.Linear(50, 20)
    x = torch.randn(9, 50)
    y = P.InnerProduct(lin.weight.detach(), lin.bias.detach(), ["relu"])(x)
    assert rel(y, torch.relu(lin(x)).detach()) < 1e-5


@pytest.mark.parametrize("groups,stride,padding,dilation", [(1, 1, 1, 1), (2, 2, 1, 1), (16, 1, 1, 1), (1, 2, 0, 2)])
@pytest.mark.parametrize("channels_last", [True, False])
def test_conv2d(groups, stride, padding, dilation, channels_last):
    conv = torch.nn.Conv2d(16, 32, 3, stride=stride, padding=padding, dilation=dilation, groups=groups).eval()
    x = torch.randn(2, 16, 13, 11)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    c = P.Conv2d(conv.weight.detach(), conv.bias.detach(), stride=stride, padding=padding, dilation=dilation,
                 groups=groups, post_ops=["relu"])
    y = c(x)
    with torch.no_grad():
        ref = torch.relu(conv(x))
    assert y.shape == ref.shape
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert rel(y, ref) < 1e-5


def test_conv2d_residual_sum_relu():
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).eval()
    x = torch.randn(1, 8, 10, 10).contiguous(memory_format=torch.channels_last)
    res = torch.randn(1, 8, 10, 10).contiguous(memory_format=torch.channels_last)
    out = res.clone()
    P.Conv2d(conv.weight.detach(), conv.bias.detach(), padding=1, post_ops=[P.PostOp("sum"), "relu"])(x, out=out)
    with torch.no_grad():
        assert rel(out, torch.relu(conv(x) + res)) < 1e-5


def test_reorder_dtype_and_layout():
    x = torch.randn(2, 3, 4, 5)
    y = P.reorder(x, torch.float32, torch.channels_last)
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, x)
    assert torch.equal(P.reorder(x, torch.bfloat16), x.bfloat16())


# ------------------------------------------------------------------ bad input: clear errors, no crash

def test_bad_inputs_raise():
    w = torch.randn(8, 4)
    mm = P.Matmul(w)
    with pytest.raises(ValueError, match="K=8"):
        mm(torch.randn(3, 7))
    with pytest.raises(TypeError, match="dtype"):
        mm(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        mm(torch.randn(8, 3).t())
    with pytest.raises(TypeError, match="torch.Tensor"):
        mm([1, 2, 3])
    with pytest.raises(TypeError):
        P.Matmul(torch.randn(8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        P.Matmul(w, torch.randn(5))
    with pytest.raises(ValueError, match="inner dimensions"):
        P.matmul(torch.randn(2, 3), torch.randn(4, 5))
    with pytest.raises(TypeError, match="equal dtypes"):
        P.matmul(torch.randn(2, 3), torch.randn(3, 5).bfloat16())
    with pytest.raises(ValueError, match="unknown post-op"):
        P.PostOp("swishy")
    with pytest.raises(ValueError, match="channels"):
        P.Conv2d(torch.randn(4, 3, 3, 3))(torch.randn(1, 5, 8, 8))
    with pytest.raises(ValueError, match="groups"):
        P.Conv2d(torch.randn(4, 3, 3, 3), groups=3)
    with pytest.raises(ValueError, match="too small"):
        P.Conv2d(torch.randn(4, 3, 5, 5))(torch.randn(1, 3, 2, 2))
    with pytest.raises(ValueError, match="out="):
        P.Matmul(w, post_ops=[P.PostOp("sum")])(torch.randn(2, 8))


def test_oneDNN_status_becomes_named_exception():
    # an impossible memory descriptor: oneDNN answers dnnl_invalid_arguments, and we say so
    from cpu_opt.dnnl.memory import MemoryDesc

    with pytest.raises(DnnlError, match="dnnl_invalid_arguments") as e:
        MemoryDesc.strided((2, 3), torch.float32, strides=(-1, 1))
    assert e.value.status == "dnnl_invalid_arguments"


# ------------------------------------------------------------------ out= buffers and operands the binding must refuse

def test_functional_matmul_refuses_wrong_out_dtype_sum_without_out_and_overlap():
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    for bad in (torch.empty(4, 6, dtype=torch.bfloat16), torch.empty(4, 6, dtype=torch.int8),
                torch.empty(4, 6, dtype=torch.float64)):
        with pytest.raises(TypeError, match="out has dtype"):
            P.matmul(a, b, out=bad)  # fp32 bytes into a 2-byte or 1-byte buffer: a heap overflow once
    with pytest.raises(ValueError, match="shape"):
        P.matmul(a, b, out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="contiguous"):
        P.matmul(a, b, out=torch.empty(6, 4).t())
    with pytest.raises(ValueError, match="sum"):
        P.matmul(a, b, post_ops=[P.PostOp("sum")])  # would add into uninitialised memory
    sq = torch.randn(6, 6)
    with pytest.raises(ValueError, match="shares memory with input 0"):
        P.matmul(sq, torch.randn(6, 6), out=sq)
    out = torch.randn(4, 6)
    ref = a @ b + out
    P.matmul(a, b, post_ops=[P.PostOp("sum")], out=out)
    assert rel(out, ref) < 1e-5


def test_layer_matmul_and_conv_refuse_bad_out_and_binary_operands():
    mm = P.Matmul(torch.randn(8, 6), post_ops=[P.PostOp("add", shape=(1, 6))])
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="out has dtype"):
        mm(x, out=torch.empty(4, 6, dtype=torch.bfloat16), binary=[torch.randn(6)])
    with pytest.raises(ValueError, match="binary post-op operand has shape"):
        mm(x, binary=[torch.randn(4, 6)])  # a full matrix where one row was declared
    with pytest.raises(ValueError, match="1 binary post-op"):
        mm(x)
    conv = P.Conv2d(torch.randn(4, 3, 3, 3), padding=1, post_ops=[P.PostOp("add", shape=(1, 4, 1, 1))])
    img = torch.randn(1, 3, 6, 6)
    with pytest.raises(ValueError, match=r"binary\[0\] has shape"):
        conv(img, binary=[torch.randn(1, 4, 6, 6)])  # was not size-checked: read past a 4-value buffer
    with pytest.raises(ValueError, match="1 binary post-op"):
        conv(img)
    with pytest.raises(TypeError, match="out has dtype"):
        conv(img, out=torch.empty(1, 4, 6, 6, dtype=torch.bfloat16), binary=[torch.randn(1, 4, 1, 1)])
    bias = torch.randn(1, 4, 1, 1)
    with torch.no_grad():
        ref = F.conv2d(img, conv._packed.src, padding=1) + bias
    assert rel(conv(img, binary=[bias]), ref) < 1e-5


def test_operands_whose_memory_does_not_hold_their_values_are_refused():
    w = torch.randn(8, 6)
    mm = P.Matmul(w)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="negated"):
        mm(torch._neg_view(x))
    with pytest.raises(ValueError, match="dense"):
        mm(x.to_sparse())
    with pytest.raises(TypeError, match="quantized"):
        P.matmul(torch.quantize_per_tensor(x, 0.1, 0, torch.qint8), torch.randn(8, 2))
    assert rel(mm(torch._neg_view(x).resolve_neg()), -(x @ w)) < 1e-5


def _from_threads(fn, inputs, rounds=30, threads=8):
    """fn(x) for every input from ``threads`` Python threads at once, ``rounds`` times each: the
    (thread, max error) pairs that differ from the serial answers."""
    import threading

    serial = [fn(x).clone() for x in inputs]
    bad, lock = [], threading.Lock()

    def work(i):
        for _ in range(rounds):
            y = fn(inputs[i % len(inputs)])
            if not torch.equal(y, serial[i % len(inputs)]):
                with lock:
                    bad.append((i, (y.float() - serial[i % len(inputs)].float()).abs().max().item()))

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return bad


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_a_primitive_run_from_eight_threads_gives_the_serial_answers(dtype):
    """Every primitive has a user scratchpad, one per calling thread: with oneDNN's library-managed
    one, fp32/bf16/int8 matmuls on AVX-512 and AMX (brg:*, gemm:jit:bf16) gave answers tens off when
    two Python threads ran them at once (AVX2's gemm:jit did not)."""
    if not probe.accepts(dtype):
        with pytest.raises(DnnlError):
            P.Matmul(torch.zeros(64, 256, dtype=torch.bfloat16))(torch.zeros(4, 64, dtype=torch.bfloat16))
        return
    g = torch.Generator().manual_seed(0)
    if dtype == "int8":
        mm = P.Matmul(torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=g), src_scale=0.02,
                      weight_scales=torch.rand(256, generator=g) * 0.01 + 1e-3, src_zero_point=128)
        inputs = [torch.randint(0, 256, (2, 16, 64), dtype=torch.uint8, generator=g) for _ in range(8)]
    else:
        dt = torch.float32 if dtype == "fp32" else torch.bfloat16
        mm = P.Matmul(torch.randn(64, 256, generator=g).to(dt), torch.randn(256, generator=g).to(dt), ["relu"])
        inputs = [torch.randn(2, 16, 64, generator=g).to(dt) for _ in range(8)]
    assert _from_threads(mm, inputs) == []
    conv = P.Conv2d(torch.randn(16, 8, 3, 3, generator=g), torch.randn(16, generator=g), padding=1)
    assert _from_threads(conv, [torch.randn(2, 8, 12, 12, generator=g) for _ in range(4)]) == []
