"""generate() on optimized Hugging Face causal LMs: the same tokens as eager's generate, with one
plan for the prefill and one for every decode step (a static cache keeps the decode shapes)."""
import warnings

import pytest
import torch

import cpu_opt
from optimize_testutil import onednn_graph_used

T = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", module="transformers")

MODELS = {
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128,
                                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                                      max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
                                                      pad_token_id=0)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_gives_eager_tokens(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():  # a model with distinct logits per step: not one token repeated
        for p in model.parameters():
            p.mul_(4.0)
    prompt = torch.randint(1, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    opt = cpu_opt.optimize(model, {"input_ids": prompt}, dtype="fp32")
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=32, do_sample=False, cache_implementation="static")
    out = opt.generate(prompt, max_new_tokens=32, do_sample=False)
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())
    assert len(set(ref[0, 10:].tolist())) > 3  # the test is not passed by repeating one token
    d = opt._generation
    assert d.calls == 32 and len(d._plans) == 2  # prefill, decode: captured once each
    for rep in d.reports():
        assert rep["validation"]["ok"] and "fell_back" not in rep["validation"]
        if onednn_graph_used():
            assert rep["num_partitions"] > 0
    assert "forward" not in model.__dict__  # the model is left as it was
    again = opt.generate(prompt, max_new_tokens=8, do_sample=False)  # plans reused
    assert torch.equal(again, ref[:, :18]) and len(d._plans) == 2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_generate_runs_the_model_in_bf16_with_a_bf16_cache(name):
    """dtype="bf16" (what "auto" means on CPUs with native bf16): generate runs a bf16 copy of the
    model, so HF's static cache and the cache tensors the prefill creates are bf16 (a float32 cache
    cannot take the plan's bf16 keys and values: index_copy_ refused them). Each token is the argmax of
    the model cast to bf16 and run eagerly (up to bf16 near-ties), and the user's model keeps its
    float32 weights. Llama's float32 RMSNorm and RoPE meet bf16 operands: autocast's casts."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    prompt = torch.randint(1, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    opt = cpu_opt.optimize(model, {"input_ids": prompt}, dtype="bf16")
    out = opt.generate(prompt, max_new_tokens=16, do_sample=False)
    import copy

    m16 = copy.deepcopy(model).to(torch.bfloat16)
    assert out.shape == (1, 26) and torch.equal(out[:, :10], prompt)
    # greedy decoding of random weights diverges at the first near-tie, so the tokens are checked one
    # by one: each is the bf16 eager model's argmax at its position (teacher-forced on cpu_opt's
    # sequence), up to a near-tie; a lost cache write or a wrong position would miss by logits' units.
    # bf16 itself moves these logits (weights x4) by 0.2-0.4 of their std from float32 (eager bf16 and
    # cpu_opt alike, measured on both attention routes), so a near-tie is a gap under 0.1 std, and most
    # tokens must be the exact argmax
    with torch.no_grad():
        logits = m16(out).logits[0, 9:-1].float()
    gap = logits.max(1).values - logits.gather(1, out[0, 10:, None])[:, 0]
    assert (gap <= 0.1 * logits.std(1)).all() and (gap == 0).sum() >= 12, (gap.tolist(), out.tolist())
    assert len(set(out[0, 10:].tolist())) > 3
    d = opt._generation
    assert len(d._plans) == 2
    for rep in d.reports():
        assert rep["validation"]["ok"] and "fell_back" not in rep["validation"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert d.model is not model and next(d.model.parameters()).dtype == torch.bfloat16


def test_generate_refuses_models_without_generate():
    m = torch.nn.Linear(4, 4).eval()
    opt = cpu_opt.optimize(m, torch.randn(2, 4), dtype="fp32")
    with pytest.raises(TypeError, match="has no generate"):
        opt.generate(torch.randn(2, 4))
