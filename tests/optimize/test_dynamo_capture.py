"""optimize on models neither torch.export nor FX symbolic tracing takes: captured through dynamo,
the traceable pieces optimized, the rest run in Python, the graph breaks reported
(cpu_opt/compiler/dynamo.py)."""
import pytest
import torch
from torch import nn

import cpu_opt
from cpu_opt.compiler import pipeline
from cpu_opt.compiler.capture import CaptureError
from cpu_opt.compiler.dynamo import DynamoModule
from optimize_testutil import onednn_graph_used


class Branchy(nn.Module):
    """Data-dependent control flow between two linear layers: export and FX both refuse it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.bn = nn.BatchNorm1d(32)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))
        if h.mean() > 0.3:  # the graph breaks here
            h = h * 2
        else:
            h = h - 1
        return torch.nn.functional.gelu(self.fc2(h))


def _close(a, b, tol=1e-4):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() < tol


def test_export_refuses_it():
    with pytest.raises(CaptureError, match="torch.export"):
        cpu_opt.optimize(Branchy().eval(), torch.randn(4, 16), dtype="int8", calibration_data=[torch.randn(4, 16)])


def test_both_branches_right_and_the_break_reported(partition_calls):
    m = Branchy().eval()
    x = torch.randn(4, 16)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    assert isinstance(opt, DynamoModule)
    with torch.no_grad():
        for inp in (x, x + 3, x - 3, torch.randn(9, 16)):  # both branches, and a new batch size
            ref = m(inp)
            partition_calls.clear()
            out = opt(inp)
            assert _close(out, ref), (out - ref).abs().max()
            if onednn_graph_used():
                assert partition_calls, "no oneDNN partition ran: the pieces went through a fallback"
    r = opt.report()
    assert r["capture"] == "dynamo"
    assert "torch.export" in r["capture_notes"][0] and "graph break" in r["capture_notes"][0]
    assert r["graph_breaks"], r
    b = r["graph_breaks"][0]
    assert "data-dependent" in b["reason"]
    assert b["where"].startswith(__file__) and "in forward" in b["where"]
    assert all(g["optimized"] and g["error"] is None for g in r["graphs"]), r["graphs"]
    assert r["validation"]["example"]["ok"]
    if onednn_graph_used():
        assert r["num_partitions"] > 0 and all("graph" in p for p in r["partitions"])
    # the report has every key an OptimizedModule's has
    plain = cpu_opt.optimize(nn.Sequential(nn.Linear(16, 8)).eval(), x, dtype="fp32").report()
    assert set(plain) <= set(r)


def test_train_mode_model_runs_in_eval_mode_and_stays_in_train_mode():
    m = Branchy().train()
    x = torch.randn(6, 16)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    assert m.training
    m.eval()
    with torch.no_grad():
        ref = m(x)
    m.train()
    out = opt(x)
    assert m.training
    assert _close(out, ref)  # BatchNorm used its running statistics, not the batch's


def test_returned_outputs_are_not_overwritten_by_the_next_call():
    m = Branchy().eval()
    x = torch.randn(4, 16)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    first = opt(x)
    kept = first.clone()
    opt(torch.randn(4, 16))
    assert torch.equal(first, kept)


def test_a_piece_that_cannot_be_optimized_runs_as_traced_and_is_reported(monkeypatch):
    real = pipeline.optimize

    def failing_pieces(model, example_inputs, **kw):
        if kw.get("_dynamo_fallback") is False:
            raise RuntimeError("boom: this piece cannot be planned")
        return real(model, example_inputs, **kw)

    monkeypatch.setattr(pipeline, "optimize", failing_pieces)
    m = Branchy().eval()
    x = torch.randn(4, 16)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    with torch.no_grad():
        assert _close(opt(x), m(x))
    r = opt.report()
    assert r["num_partitions"] == 0
    assert r["graphs"] and all(not g["optimized"] and "boom" in g["error"] for g in r["graphs"])
    assert any("boom" in f["reason"] for f in r["fallbacks"])


def test_disagreement_with_eager_runs_the_model_eagerly(monkeypatch):
    real = pipeline._compare
    monkeypatch.setattr(pipeline, "_compare", lambda out, ref, dt, min_cosine=None:
                        {**real(out, ref, dt, min_cosine), "ok": False})
    m = Branchy().eval()
    x = torch.randn(4, 16)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    with torch.no_grad():
        assert torch.equal(opt(x), m(x))  # eager PyTorch itself
    r = opt.report()
    assert r["num_partitions"] == 0 and not r["validation"]["example"]["ok"]
    assert any("runs in eager PyTorch" in n for n in r["capture_notes"])


def test_a_transformers_model_behind_a_data_dependent_branch(partition_calls):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=1000)

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert, self.head = transformers.BertModel(cfg), nn.Linear(64, 3)

        def forward(self, input_ids, attention_mask):
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            if h[:, 0].norm() > 5:  # a data-dependent early decision on the encoder's output
                return self.head(h[:, 0])
            return self.head(h.mean(1))

    m = Gate().eval()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    inp = {"input_ids": torch.randint(0, 1000, (2, 16)), "attention_mask": mask}
    opt = cpu_opt.optimize(m, inp, dtype="fp32")
    assert isinstance(opt, DynamoModule)
    with torch.no_grad():
        for i in (inp, {"input_ids": torch.randint(0, 1000, (1, 24)), "attention_mask": torch.ones(1, 24, dtype=torch.long)}):
            partition_calls.clear()
            out = opt(**i)
            assert _close(out, m(**i))
            if onednn_graph_used():
                assert partition_calls
    r = opt.report()
    assert r["graph_breaks"] and all(g["error"] is None for g in r["graphs"])
    if onednn_graph_used():
        assert r["graphs"][0]["num_partitions"] > 0  # the encoder, before the branch, was optimized


def test_generate_of_a_causal_lm_only_dynamo_can_capture(partition_calls):
    """A GPT-2 whose forward has a data-dependent check (export refuses it) comes back as a
    DynamoModule; its generate() runs Hugging Face's own loop with every forward through the
    optimized pieces and gives eager's tokens (greedy, with its KV cache)."""
    import transformers

    class Checked(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, **kw):
            if bool((input_ids < 0).any()):   # data-dependent: torch.export cannot take it
                raise ValueError("negative token id")
            return super().forward(input_ids=input_ids, **kw)

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    m = Checked(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)          # random weights that do not decode one token over and over
    prompt = torch.randint(1, 300, (1, 10))
    opt = cpu_opt.optimize(m, {"input_ids": prompt}, dtype="fp32")
    assert isinstance(opt, DynamoModule)
    kw = dict(max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        ref = m.generate(prompt, **kw)
    n_graphs = len(opt.report()["graphs"])
    partition_calls.clear()
    out = opt.generate(prompt, **kw)
    assert torch.equal(out, ref)
    assert type(m).forward is Checked.forward and "forward" not in m.__dict__   # put back
    r = opt.report()
    assert len(r["graphs"]) > n_graphs                   # generate's forward pieces, captured and listed
    if onednn_graph_used():
        assert len(partition_calls) > 0                   # they ran on the oneDNN plans
    with pytest.raises(AttributeError, match="has no generate"):
        cpu_opt.optimize(Branchy().eval(), torch.randn(6, 16), dtype="fp32").generate(torch.ones(1))
