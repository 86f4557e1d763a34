"""The Graph API: MatMul+BiasAdd+ReLU and Convolution+BiasAdd+ReLU fuse into one partition each
and match torch."""
import pytest
import torch

from cpu_opt.dnnl.graph import Graph


def _run(part, by_id):
    return part.compile()([by_id[t.id] for t in part.inputs])


def test_matmul_biasadd_relu_one_partition():
    g = Graph()
    x = g.tensor((64, 256), torch.float32)
    w = g.tensor((256, 128), torch.float32, constant=True)
    b = g.tensor((128,), torch.float32, constant=True)
    mm = g.tensor((64, 128), torch.float32, layout="any")
    ad = g.tensor((64, 128), torch.float32, layout="any")
    y = g.tensor((64, 128), torch.float32)
    g.op("MatMul", [x, w], [mm])
    g.op("BiasAdd", [mm, b], [ad])
    g.op("ReLU", [ad], [y])
    parts = g.partitions()
    assert len(parts) == 1 and parts[0].supported
    assert parts[0].op_kinds == ["MatMul", "BiasAdd", "ReLU"]
    xt, wt, bt = torch.randn(64, 256), torch.randn(256, 128), torch.randn(128)
    (out,) = _run(parts[0], {x.id: xt, w.id: wt, b.id: bt})
    ref = torch.relu(xt.double() @ wt.double() + bt.double())
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_conv_biasadd_relu_one_partition():
    N, C, H, W, O = 2, 16, 14, 14, 32
    g = Graph()
    x = g.tensor((N, H, W, C), torch.float32)
    w = g.tensor((3, 3, C, O), torch.float32, constant=True)
    b = g.tensor((O,), torch.float32, constant=True)
    c = g.tensor((N, H, W, O), torch.float32, layout="any")
    ad = g.tensor((N, H, W, O), torch.float32, layout="any")
    y = g.tensor((N, H, W, O), torch.float32)
    g.op("Convolution", [x, w], [c], strides=[1, 1], pads_begin=[1, 1], pads_end=[1, 1], dilations=[1, 1],
         groups=1, data_format="NXC", weights_format="XIO")
    g.op("BiasAdd", [c, b], [ad], data_format="NXC")
    g.op("ReLU", [ad], [y])
    parts = g.partitions()
    assert len(parts) == 1 and parts[0].op_kinds == ["Convolution", "BiasAdd", "ReLU"]
    conv = torch.nn.Conv2d(C, O, 3, padding=1)
    xt = torch.randn(N, C, H, W)
    (out,) = _run(parts[0], {x.id: xt.permute(0, 2, 3, 1).contiguous(),
                             w.id: conv.weight.detach().permute(2, 3, 1, 0).contiguous(), b.id: conv.bias.detach()})
    with torch.no_grad():
        ref = torch.relu(conv(xt)).permute(0, 2, 3, 1)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_compiled_partition_checks_inputs():
    g = Graph()
    x = g.tensor((4, 8), torch.float32)
    y = g.tensor((4, 8), torch.float32)
    g.op("ReLU", [x], [y])
    (p,) = g.partitions()
    cp = p.compile()
    with pytest.raises(ValueError, match="compiled for"):
        cp([torch.randn(4, 9)])
    with pytest.raises(ValueError, match="expected 1 inputs"):
        cp([])
    assert torch.equal(cp([torch.tensor([[-1.0] * 8] * 4)])[0], torch.zeros(4, 8))


def test_unknown_op_and_attr():
    g = Graph()
    x = g.tensor((2,), torch.float32)
    with pytest.raises(ValueError, match="unknown oneDNN Graph op kind"):
        g.op("Frobnicate", [x], [x])
    with pytest.raises(ValueError, match="unknown oneDNN Graph attribute"):
        g.op("ReLU", [x], [g.tensor((2,), torch.float32)], wibble=1)


def test_compiled_partition_checks_the_outputs_it_is_given():
    g = Graph()
    x = g.tensor((4, 8), torch.float32)
    y = g.tensor((4, 8), torch.float32)
    g.op("ReLU", [x], [y])
    (p,) = g.partitions()
    cp = p.compile()
    inp = torch.randn(4, 8)
    with pytest.raises(ValueError, match="expected 1 outputs, got 0"):
        cp([inp], [])  # would leave a stale handle bound
    with pytest.raises(ValueError, match="expected 1 outputs, got 2"):
        cp([inp], [torch.empty(4, 8), torch.empty(4, 8)])  # read past the handle array
    with pytest.raises(ValueError, match="output 0 is"):
        cp([inp], [torch.empty(2, 8)])  # too small: oneDNN would write 32 floats into 16
    with pytest.raises(ValueError, match="output 0 is"):
        cp([inp], [torch.empty(4, 8, dtype=torch.float64)])
    with pytest.raises(ValueError, match="output 0 is"):
        cp([inp], [torch.empty(8, 4).t()])  # another stride
    with pytest.raises(ValueError, match="shares memory with input 0"):
        cp([inp], [inp])
    with pytest.raises(TypeError, match="torch.Tensor"):
        cp([inp], [None])
    out = torch.full((4, 8), 7.0)
    assert cp([inp], [out])[0] is out and torch.equal(out, inp.relu())
