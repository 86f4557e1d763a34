"""Eight Python threads calling one optimized model (fp32 and bf16), every GNN op and a
gnn.optimize model at once get exactly the serial answers, and the primitive cache's counters add
up (every lookup a hit or a miss; every miss a creation, a wait for another thread's creation, or a
failure)."""
import threading

import pytest
import torch

import cpu_opt
from cpu_opt import dnnl, gnn
from cpu_opt.models import ZOO

THREADS, ITERS = 8, 12


def _hammer(fn, inputs):
    """Run ``fn(inputs[k])`` from THREADS threads, ITERS times each over all inputs; return the
    results with the input index, and any exception."""
    errors, results = [], []
    start = threading.Barrier(THREADS)

    def work(tid):
        try:
            start.wait()
            for it in range(ITERS):
                k = (tid + it) % len(inputs)
                results.append((k, fn(inputs[k])))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    return results


def _leaves(out):
    import torch.utils._pytree as pytree

    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _counting(monkeypatch):
    calls = [0]
    orig = dnnl.CACHE.get_or_create
    lock = threading.Lock()

    def counted(key, factory):
        with lock:
            calls[0] += 1
        return orig(key, factory)

    monkeypatch.setattr(dnnl.CACHE, "get_or_create", counted)
    return calls


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["bert_base", "resnet18"])
def test_one_optimized_model_from_eight_threads_gives_the_serial_answers(name, dtype, monkeypatch):
    spec = ZOO[name]
    model = spec.build("small")
    opt = cpu_opt.optimize(model, spec.example_inputs(2, "small"), dtype=dtype)
    torch.manual_seed(1)
    inputs = [spec.example_inputs(2, "small") for _ in range(4)]
    serial = [[t.clone() for t in _leaves(spec.call(opt, x))] for x in inputs]
    dnnl.CACHE.reset_stats()
    calls = _counting(monkeypatch)
    results = _hammer(lambda x: spec.call(opt, x), inputs)
    for k, out in results:
        for a, b in zip(_leaves(out), serial[k], strict=True):
            assert torch.equal(a, b), f"thread result differs from the serial one ({name}, {dtype})"
    st = dnnl.cache_stats()
    assert st.hits + st.misses == calls[0]
    assert st.misses == st.creations + st.shared + st.failures
    assert st.failures == 0


def test_every_gnn_op_from_eight_threads_gives_the_serial_answers():
    g = torch.Generator().manual_seed(0)
    graphs = []
    for s in range(4):
        ei = torch.randint(0, 300, (2, 2000), generator=torch.Generator().manual_seed(s))
        graphs.append((gnn.CSRGraph.from_edge_index(ei, 300), ei, torch.randn(300, 24, generator=g),
                       torch.randn(2000, 24, generator=g)))

    def ops(item):
        adj, ei, x, src = item
        xg = x.clone().requires_grad_()
        y = gnn.spmm(adj, xg, "max")
        (y * y).sum().backward()
        return (gnn.scatter(src, ei[1], 0, 300, "mean"), gnn.scatter(src, ei[1], 0, 300, "min"),
                gnn.gather(x, ei[0]), gnn.spmm(adj, x, "sum"), y.detach(), xg.grad)

    serial = [ops(it) for it in graphs]
    for k, out in _hammer(ops, graphs):
        for a, b in zip(out, serial[k], strict=True):
            assert torch.equal(a, b)


def test_a_gnn_optimize_model_from_eight_threads_gives_the_serial_answers():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import SAGEConv

    torch.manual_seed(0)
    fast = gnn.optimize(SAGEConv(8, 6, aggr="max"))
    graphs = [(torch.randn(50, 8), torch.randint(0, 50, (2, 300), generator=torch.Generator().manual_seed(s)))
              for s in range(5)]
    with torch.no_grad():
        serial = [fast(x, ei) for x, ei in graphs]

    def call(item):
        with torch.no_grad():
            return fast(*item)

    for k, y in _hammer(call, graphs):
        assert torch.equal(y, serial[k])


@pytest.mark.parametrize("form", ["optimize", "convert"])
@pytest.mark.parametrize("name", ["resnet18", "bert_base"])
def test_an_int8_model_from_eight_threads_gives_the_serial_answers(name, form):
    """int8 (cpu_opt.quant): the optimized graph (fused, chained uint8) and the converted module."""
    from cpu_opt import quant

    spec = ZOO[name]
    model = spec.build("small")
    torch.manual_seed(2)
    calib = [spec.example_inputs(2, "small") for _ in range(2)]
    if form == "optimize":
        m = cpu_opt.optimize(model, calib[0], dtype="int8", calibration_data=calib)
        assert m.report()["int8"] and "fell_back" not in m.report()["validation"]
    else:
        p = quant.prepare(model)
        for x in calib:
            spec.call(p, x)
        m = quant.convert(p)
        assert quant.report(m)["layers"]
    inputs = [spec.example_inputs(2, "small") for _ in range(4)]
    with torch.no_grad():
        serial = [[t.clone() for t in _leaves(spec.call(m, x))] for x in inputs]

    def call(x):
        with torch.no_grad():
            return spec.call(m, x)

    for k, out in _hammer(call, inputs):
        for a, b in zip(_leaves(out), serial[k], strict=True):
            assert torch.equal(a, b), f"thread result differs from the serial one ({name}, int8 {form})"
