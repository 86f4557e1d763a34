"""native/kernels/gather.c — gather_rows (float32) and gather_rows_bytes (any dtype) through
gnn.gather / gnn.index_select, into fresh or preallocated outputs."""
import pytest
import torch

from cpu_opt import gnn

from gnn_testutil import RUNNABLE_VARIANTS


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_matches_index_select(variant, dtype, index_dtype):
    torch.manual_seed(0)
    src = (torch.randn(50, 3, 7) * 10).to(dtype)
    index = torch.randint(0, 50, (200,)).to(index_dtype)
    with gnn.use_variant(variant):
        assert torch.equal(gnn.gather(src, index), src.index_select(0, index))
        out = torch.empty(200, 3, 7, dtype=dtype)
        assert gnn.index_select(src, index, out=out) is out
        assert torch.equal(out, src.index_select(0, index))


@pytest.mark.parametrize("shape", [(0, 4), (5, 0), (1, 1), (7,)])
def test_gather_edge_shapes(shape):
    src = torch.randn(*shape)
    index = torch.zeros(3, dtype=torch.int64) if shape[0] else torch.zeros(0, dtype=torch.int64)
    assert torch.equal(gnn.gather(src, index), src.index_select(0, index))
    assert gnn.gather(src, index[:0]).shape == (0,) + tuple(shape[1:])


def test_gather_large_parallel():
    src = torch.randn(5000, 64)
    index = torch.randint(0, 5000, (60000,))
    assert torch.equal(gnn.gather(src, index), src[index])


def test_gather_errors_leave_out_untouched():
    src = torch.randn(6, 4)
    out = torch.full((3, 4), 42.0)
    with pytest.raises(IndexError, match=r"index\[2\] = 6"):
        gnn.gather(src, torch.tensor([0, 5, 6]), out=out)
    assert bool((out == 42.0).all())
    with pytest.raises(IndexError, match=r"index\[0\] = -1"):
        gnn.gather(src, torch.tensor([-1, 0, 1]), out=out)
    assert bool((out == 42.0).all())
    with pytest.raises(ValueError, match="out must be a contiguous"):
        gnn.gather(src, torch.tensor([0, 1, 2]), out=torch.empty(3, 5))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        gnn.gather(src, torch.tensor([0, 1, 2]), out=torch.empty(3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="index must have dtype"):
        gnn.gather(src, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="index must be 1-D"):
        gnn.gather(src, torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        gnn.gather([1, 2], torch.tensor([0]))
    with pytest.raises(RuntimeError, match="not differentiable"):
        gnn.gather(src.requires_grad_(), torch.tensor([0, 1, 2]), out=out)
