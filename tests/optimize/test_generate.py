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


def test_generate_refuses_models_without_generate():
    m = torch.nn.Linear(4, 4).eval()
    opt = cpu_opt.optimize(m, torch.randn(2, 4), dtype="fp32")
    with pytest.raises(TypeError, match="has no generate"):
        opt.generate(torch.randn(2, 4))
