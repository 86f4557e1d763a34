"""optimize(..., dynamic=True, buckets=...): inputs padded to bucket lengths, outputs sliced back,
one plan per bucket, padding validated against eager at the true length (cpu_opt/compiler/buckets.py)."""
import pytest
import torch
from torch import nn

import cpu_opt
from optimize_testutil import onednn_graph_used

transformers = pytest.importorskip("transformers")


def _bert(max_positions=512):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100, max_position_embeddings=max_positions)
    return transformers.BertModel(cfg).eval()


def _tokens(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(1, 100, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if length > 3:
        mask[0, -2:] = 0  # the model's own padding inside the true length stays masked too
    return {"input_ids": ids, "attention_mask": mask}


class MeanPool(nn.Module):
    """Does not mask: a mean over the sequence sees every padded position."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc, self.norm = nn.Embedding(100, 16), nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, input_ids, attention_mask):
        h = nn.functional.gelu(self.norm(self.fc(self.emb(input_ids))))
        return {"tokens": h, "pooled": h.mean(1)}


class Tokens(nn.Module):
    """Position-wise only: padding never reaches the true positions."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.norm = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.fc2(nn.functional.gelu(self.fc1(x))))


def _close(out, ref, atol=1e-4):
    assert type(out) is type(ref)
    for name in ("last_hidden_state", "pooler_output"):
        a, b = getattr(out, name), getattr(ref, name)
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


def test_masked_bert_pads_to_buckets_and_matches_eager(partition_calls):
    m = _bert()
    opt = cpu_opt.optimize(m, _tokens(2, 8), dtype="fp32", dynamic=True,
                           buckets=cpu_opt.Buckets(sizes=(32, 64, 128), pad_values={"attention_mask": 0}))
    before = opt.report()["plans_compiled"]
    for length in (5, 17, 30, 64):
        inp = _tokens(2, length)
        with torch.no_grad():
            ref = m(**inp)
        partition_calls.clear()
        out = opt(**inp)
        _close(out, ref)
        if onednn_graph_used():
            assert partition_calls, "no oneDNN partition ran: the bucket plan went through a fallback"
    r = opt.report()
    b = r["buckets"]
    assert b["disabled"] is None, b
    assert b["calls_per_bucket"] == {32: 3, 64: 1}
    assert b["plans_compiled"] == 2 and r["plans_compiled"] - before == 2  # buckets 32 and 64, not 4 lengths
    assert {p["input"] for p in b["padded_inputs"]} == {"input_ids", "attention_mask"}
    assert [s["output"] for s in b["sliced_outputs"]] == ["last_hidden_state"]  # the pooler has no sequence dim
    assert [(v["bucket"], v["length"], v["ok"]) for v in b["validated"]] == [(32, 5, True)]  # 64: nothing padded
    assert b["dynamic_implied"] is False


def test_a_model_that_does_not_mask_switches_bucketing_off():
    m = MeanPool().eval()
    opt = cpu_opt.optimize(m, _tokens(2, 8), dtype="fp32", buckets=(16, 32))  # buckets imply dynamic=True
    for length in (5, 12, 20, 12):
        inp = _tokens(2, length)
        with torch.no_grad():
            ref = m(**inp)
        out = opt(**inp)
        assert set(out) == {"tokens", "pooled"} and out["tokens"].shape == ref["tokens"].shape
        torch.testing.assert_close(out["pooled"], ref["pooled"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out["tokens"], ref["tokens"], atol=1e-4, rtol=1e-4)
    b = opt.report()["buckets"]
    assert b["dynamic_implied"] is True
    assert b["disabled"] and "padding changed the answer" in b["disabled"] and "length 5 padded to 16" in b["disabled"]
    assert [v["ok"] for v in b["validated"]] == [False]
    assert b["calls_per_bucket"] == {} and b["calls_unbucketed"]["disabled"] == 4
    assert opt.report()["shapes_compiled"] == 5  # the example, bucket 16 (tried), then 5, 12 and 20 each


def test_bert_called_without_its_mask_is_not_padded():
    m = _bert()
    ex = {"input_ids": _tokens(2, 8)["input_ids"]}
    opt = cpu_opt.optimize(m, ex, dtype="fp32", buckets=(16, 32))
    inp = {"input_ids": _tokens(2, 11)["input_ids"]}
    with torch.no_grad():
        ref = m(**inp)
    _close(opt(**inp), ref)
    assert "padding changed the answer" in opt.report()["buckets"]["disabled"]


def test_lengths_above_the_largest_bucket_run_on_plans_of_their_own():
    m = Tokens().eval()
    opt = cpu_opt.optimize(m, torch.randn(2, 8, 16), dtype="fp32", dynamic=True, buckets=(16, 32))
    for length in (40, 7, 40, 50):
        x = torch.randn(2, length, 16)
        with torch.no_grad():
            ref = m(x)
        torch.testing.assert_close(opt(x), ref, atol=1e-4, rtol=1e-4)
    b = opt.report()["buckets"]
    assert b["disabled"] is None
    assert b["calls_unbucketed"]["above_largest"] == 3 and b["calls_per_bucket"] == {16: 1}
    assert b["padded_inputs"] == [{"input": "x", "dims": [1], "pad_value": 0}]  # forward's parameter name
    assert opt.report()["shapes_compiled"] == 4  # the example, bucket 16, lengths 40 and 50
    with pytest.raises(ValueError, match="rank 2"):  # checked as without buckets, on the unpadded input
        opt(torch.randn(2, 8))


def test_earlier_outputs_are_not_overwritten_by_later_calls():
    m = _bert()
    opt = cpu_opt.optimize(m, _tokens(1, 8), dtype="fp32", buckets=(16, 32))
    first = opt(**_tokens(1, 5))
    kept = first.last_hidden_state.clone(), first.pooler_output.clone()
    for length in (6, 9, 16, 20, 5):
        opt(**_tokens(1, length, seed=length))
    assert torch.equal(first.last_hidden_state, kept[0]) and torch.equal(first.pooler_output, kept[1])
    assert opt.report()["buckets"]["calls_per_bucket"] == {16: 5, 32: 1}


def test_bad_specs_raise_clearly():
    B = cpu_opt.Buckets
    for kwargs, match in [({"sizes": (64, 32)}, "sorted ascending"), ({"sizes": (32, 32)}, "sorted ascending"),
                          ({"sizes": (0, 32)}, "positive ints"), ({"sizes": ()}, "empty"),
                          ({"sizes": (8, 16.0)}, "positive ints"), ({"sizes": (True, 8)}, "positive ints")]:
        with pytest.raises(ValueError, match=match):
            B(**kwargs)
    with pytest.raises(TypeError, match="sequence of ints"):
        B(sizes=32)
    with pytest.raises(TypeError, match="dim must be an int"):
        B(sizes=(8,), dim="1")
    with pytest.raises(TypeError, match="pad_values"):
        B(sizes=(8,), pad_values=[0])
    m, ex = MeanPool().eval(), _tokens(2, 8)
    with pytest.raises(ValueError, match="'input_idz'.*the inputs are \\['input_ids', 'attention_mask'\\]"):
        cpu_opt.optimize(m, ex, buckets=B(sizes=(16,), pad_values={"input_idz": 0}))
    with pytest.raises(ValueError, match="dim=2 does not exist on input 'input_ids'"):
        cpu_opt.optimize(m, ex, buckets=B(sizes=(16,), dim=2, pad_values={"input_ids": 0}))
    with pytest.raises(ValueError, match="dynamic=True"):
        cpu_opt.optimize(m, ex, dynamic=False, buckets=(16,))
    with pytest.raises(TypeError, match="cpu_opt.Buckets"):
        cpu_opt.optimize(m, ex, buckets={"sizes": (16,)})
    with pytest.raises(ValueError, match="size 1 along dim 1 in the example"):  # export specializes a length of 1
        cpu_opt.optimize(m, _tokens(2, 1), dtype="fp32", buckets=B(sizes=(16,), pad_values={"input_ids": 0}))
    with pytest.raises(ValueError, match="every input has size 0 or 1"):
        cpu_opt.optimize(m, _tokens(2, 1), dtype="fp32", buckets=(16,))
    with pytest.raises(ValueError, match="at most 64"):  # BERT's position table ends at 64
        cpu_opt.optimize(_bert(max_positions=64), _tokens(2, 8), dtype="fp32", buckets=(32, 128))
