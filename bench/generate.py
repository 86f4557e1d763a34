"""python -m bench generate: greedy generation with a Hugging Face GPT-2 (full-size config, random
weights), tokens per second under eager PyTorch, torch.compile and cpu_opt.

All three use HF's own ``generate`` with a static KV cache (``cache_implementation="static"``,
what HF recommends for torch.compile): eager as it is; torch.compile with the model's forward
compiled (inductor, the global freezing flag on: ``options=`` alone freezes nothing in torch 2.13);
cpu_opt through ``cpu_opt.optimize(model, ...).generate``. Each is warmed up once (its compile /
optimize time recorded), then the three are timed interleaved; tokens are checked equal to
eager's. Prompt 32 tokens, 32 new tokens, batch 1 (--prompt, --new-tokens, --repeats).

``--int8`` adds cpu_opt's int8 forms: ``optimize(dtype="int8", calibration_data=8 seeded prompts)``
(static activations: the prefill's calibration serves the decode plan too) and
``quant.quantize_dynamic`` (int8 weights, per-call activations; GPT-2's Conv1D layers included)
then ``optimize``. Their tokens are not expected to equal fp32 eager's: the column says what
fraction of the generated tokens agree.

``--bf16`` adds the bf16 forms: eager and torch.compile on the model cast to bf16
(``model.to(torch.bfloat16)``, HF's static cache then bf16 too) and ``cpu_opt.optimize(model,
dtype="bf16").generate`` (which runs such a copy); their agreement with fp32 eager's tokens is stated.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

from bench.runner import Report, measure


def _model(quick: bool):
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GPT2Config(bos_token_id=0, eos_token_id=0, pad_token_id=0) if not quick else \
        T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128, bos_token_id=0,
                     eos_token_id=0, pad_token_id=0)
    m = T.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # random weights scaled up so greedy decoding does not repeat one token
        for p in m.parameters():
            p.mul_(2.0)
    return m, cfg


def _compiled_generate(model, prompt, kw):
    """``(runner, first output, seconds)`` for ``generate`` on a copy of ``model`` whose forward
    torch.compile compiled (inductor, the global freezing flag), the first call compiling it."""
    import copy

    import torch._inductor.config as inductor_config

    cmodel = copy.deepcopy(model)
    inductor_config.freezing = True
    cmodel.forward = torch.compile(cmodel.forward, dynamic=False)

    def run():
        with torch.no_grad():
            return cmodel.generate(prompt, **kw)

    t0 = time.perf_counter()
    out = run()
    return run, out, time.perf_counter() - t0


def main(quick: bool = False, argv=None) -> None:
    import cpu_opt

    ap = argparse.ArgumentParser(prog="python -m bench generate")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8 if quick else 32)
    ap.add_argument("--repeats", type=int, default=3 if quick else 5)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--int8", action="store_true", help="also cpu_opt's int8 forms")
    ap.add_argument("--bf16", action="store_true", help="also the bf16 forms (eager, torch.compile, cpu_opt)")
    args, _ = ap.parse_known_args(argv or [])
    warnings.filterwarnings("ignore")
    model, cfg = _model(quick)
    prompt = torch.randint(1, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False, cache_implementation="static")
    from bench.runner import machine_slug

    # the Zen 3's tables are generate.json / generate_int8.json; other CPUs write their own files
    slug = machine_slug()
    suffix = "" if slug == "zen_3" else f"_{slug}"
    rep = Report(("generate_quick" if quick else "generate") + ("_int8" if args.int8 else "") + ("_bf16" if args.bf16 else "") + suffix, model="GPT2LMHeadModel " + ("small" if quick else "124M"),
                 prompt=args.prompt, new_tokens=args.new_tokens)

    with torch.no_grad():
        ref = model.generate(prompt, **kw)
    runners, build = {}, {}
    runners["eager"] = lambda: model.generate(prompt, **kw)

    t0 = time.perf_counter()
    opt = cpu_opt.optimize(model, {"input_ids": prompt}, dtype="fp32")
    out = opt.generate(prompt, **kw)
    build["cpu_opt"] = time.perf_counter() - t0
    runners["cpu_opt"] = lambda: opt.generate(prompt, **kw)
    same = {"cpu_opt": bool(torch.equal(out, ref))}

    agree = {}
    if args.int8:
        from cpu_opt import quant

        calib = [{"input_ids": torch.randint(1, cfg.vocab_size, (1, args.prompt),
                                             generator=torch.Generator().manual_seed(100 + i))} for i in range(8)]
        t0 = time.perf_counter()
        o8 = cpu_opt.optimize(model, {"input_ids": prompt}, dtype="int8", calibration_data=calib)
        out8 = o8.generate(prompt, **kw)
        build["cpu_opt_int8"] = time.perf_counter() - t0
        runners["cpu_opt_int8"] = lambda: o8.generate(prompt, **kw)
        t0 = time.perf_counter()
        od = cpu_opt.optimize(quant.quantize_dynamic(model), {"input_ids": prompt}, dtype="fp32")
        outs = [("cpu_opt_int8", out8)]
        if hasattr(od, "generate"):
            outd = od.generate(prompt, **kw)
            build["cpu_opt_dynamic_int8"] = time.perf_counter() - t0
            runners["cpu_opt_dynamic_int8"] = lambda: od.generate(prompt, **kw)
            outs.append(("cpu_opt_dynamic_int8", outd))
        else:   # torch.export could not capture the dynamically quantized model: dynamo's capture has no generate
            print(f"cpu_opt_dynamic_int8: not measured ({od.report().get('capture')} capture, no generate): "
                  f"{od.report().get('capture_notes', '')[:200]}")
        new = slice(args.prompt, None)
        for k, o in outs:
            same[k] = bool(torch.equal(o, ref))
            agree[k] = float((o[:, new] == ref[:, new]).float().mean())

    if args.bf16:
        import copy

        m16 = copy.deepcopy(model).to(torch.bfloat16)

        def eager16():
            with torch.no_grad():
                return m16.generate(prompt, **kw)

        runners["eager_bf16"] = eager16
        t0 = time.perf_counter()
        ob = cpu_opt.optimize(model, {"input_ids": prompt}, dtype="bf16")
        outb = ob.generate(prompt, **kw)
        build["cpu_opt_bf16"] = time.perf_counter() - t0
        runners["cpu_opt_bf16"] = lambda: ob.generate(prompt, **kw)
        outs16 = [("eager_bf16", eager16()), ("cpu_opt_bf16", outb)]
        if not args.skip_compile:
            runners["torch.compile_bf16"], out, build["torch.compile_bf16"] = _compiled_generate(m16, prompt, kw)
            outs16.append(("torch.compile_bf16", out))
        new = slice(args.prompt, None)
        for k, o in outs16:
            same[k] = bool(torch.equal(o, ref))
            agree[k] = float((o[:, new] == ref[:, new]).float().mean())

    if not args.skip_compile:
        runners["torch.compile"], cout, build["torch.compile"] = _compiled_generate(model, prompt, kw)
        same["torch.compile"] = bool(torch.equal(cout, ref))

    def eager():
        with torch.no_grad():
            return model.generate(prompt, **kw)

    runners["eager"] = eager
    st = measure(runners, warmup=1, repeats=args.repeats)
    for name, s in st.items():
        rep.add(impl=name, seconds=s.median, tokens_per_s=args.new_tokens / s.median,
                speedup_vs_eager=st["eager"].median / s.median, build_s=build.get(name),
                same_tokens_as_eager=same.get(name, True), tokens_agreeing=agree.get(name), spread=s.spread)
    rep.print_table(["impl", "seconds", "tokens_per_s", "speedup_vs_eager", "build_s", "same_tokens_as_eager",
                     "tokens_agreeing", "spread"])
    rep.save()


if __name__ == "__main__":
    main()
