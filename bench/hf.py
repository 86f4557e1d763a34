"""python -m bench hf: full-size Hugging Face models (random weights, no downloads) at batch 1 under
eager PyTorch, torch.compile (inductor, the global freezing flag), cpu_opt.optimize and OpenVINO,
fp32 (OpenVINO with INFERENCE_PRECISION_HINT=f32).

Every implementation of every model runs in a process of its own (OpenVINO's spinning worker
threads slowed torch runs next to them up to 5x, shared/KNOWN.md), and the processes alternate
over ``--rounds`` rounds: eager, compile, cpu_opt, OpenVINO, eager, ... Each process builds its
implementation (the time is recorded: torch.compile's first compile, optimize() + first call,
OpenVINO's convert + compile), checks its output against eager (cosine), and times ``--repeats``
calls; a model's figure per implementation is the median over the rounds of the per-process
medians. Each process runs under the machine's benchmark lock (``bench.runner.bench_lock``; do not
wrap the run in ``flock`` yourself). Results go to ``bench/results/hf[_int8|_bf16][_b<batch>]_<cpu>.json`` (+ ``.png``): one file
per CPU, so the tables of other machines stay. Models: BERT-base (seq 128, padding in the mask), GPT-2 (seq 128, no cache),
ViT-B/16 (224²), ResNet-50 (224²), ConvNeXt-T (224²).

int8 (``python -m bench hf --int8``: ``INT8_IMPLS``, the int8 forms with eager and cpu_opt fp32; ``python
-m bench quant`` runs it at batch 1 and 16 and the zoo's int8): each is calibrated on the same 8 seeded inputs
(shaped like the example): ``cpu_opt.optimize(dtype="int8", calibration_data=...)``; torchao's
pt2e flow (``X86InductorQuantizer``, static per-tensor activations, per-channel weights) lowered
by ``torch.compile`` with freezing; torch.ao's FX flow (``prepare_fx``/``convert_fx``, x86 engine);
torch's ``quantize_dynamic`` (Linear layers; FBGEMM); OpenVINO
with NNCF's ``nncf.quantize`` (when nncf is installed); ONNX Runtime's ``quantize_dynamic`` and
``quantize_static`` (QDQ, U8S8 per-channel) on the model exported by torch's TorchScript exporter. int8
cosines are against eager fp32. ONNX Runtime fp32 is ``--impls onnxruntime`` (not in the default set).
The runtimes compared against: ``pip install 'cpu_opt[compare]'`` and ``pip install torchao --no-deps``.

bf16 (``python -m bench hf --bf16``, for CPUs with native bf16 math; results in hf_bf16_<cpu>.json):
eager fp32 as the baseline, eager and torch.compile (freezing) under ``torch.autocast("cpu",
torch.bfloat16)``, ``cpu_opt.optimize(dtype="bf16")`` and OpenVINO with
``INFERENCE_PRECISION_HINT=bf16``. Cosines against eager fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = ("bert", "gpt2", "vit", "resnet50", "convnext")
IMPLS = ("eager", "compile", "cpu_opt", "openvino")
INT8_IMPLS = ("eager", "cpu_opt", "cpu_opt_int8", "torchao_int8", "fx_int8", "dynamic_int8", "openvino_int8",
              "ort_dynamic_int8", "ort_static_int8")
OPTIONAL_IMPLS = ("onnxruntime",)   # ONNX Runtime fp32: asked for by name (--impls)
BF16_IMPLS = ("eager", "eager_bf16", "compile_bf16", "cpu_opt_bf16", "openvino_bf16")

LOCKS_ITSELF = True   # the machine lock around each measuring process, not the whole run (bench.__main__)



def calibration_inputs(name: str, inputs: dict, n: int = 8) -> list[dict]:
    """``n`` seeded inputs shaped like the example (token ids drawn again, the mask kept)."""
    from bench.runner import calibration_batches

    return calibration_batches(inputs, n)


def _torchao_int8(model, inputs, calib):
    """torchao's pt2e static int8 (X86InductorQuantizer), lowered by inductor with freezing (the
    global flag: shared/KNOWN.md, "torch.compile's freezing switch")."""
    import torch
    import torch._inductor.config as inductor_config
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    gm = torch.export.export(model, (), inputs, strict=False).module()
    prepared = prepare_pt2e(gm, quantizer)
    with torch.no_grad():
        for item in calib:
            prepared(**item)
    converted = convert_pt2e(prepared)
    inductor_config.freezing = True
    c = torch.compile(converted)
    return lambda: c(**inputs)


def _positional(model, names):
    """``model`` taking its inputs positionally (``names`` order, one named parameter each: tracers such
    as torch.fx's cannot iterate a ``*args``) and returning its main output tensor: what exporters and
    OpenVINO's converter trace (users adapt Hugging Face models the same way)."""
    import torch

    if not all(n.isidentifier() for n in names):
        raise ValueError(f"input names must be identifiers: {names}")
    ns: dict = {}
    exec(f"def forward(self, {', '.join(names)}):\n"   # noqa: S102 - a signature built from the input names
         f"    return _main_tensor(self.m({', '.join(f'{n}={n}' for n in names)}))", {"_main_tensor": _main_tensor}, ns)

    class Positional(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

    Positional.forward = ns["forward"]
    return Positional(model).eval()


def _fx_int8(model, inputs, calib):
    """torch.ao's FX graph-mode static int8 (``prepare_fx`` / ``convert_fx``, the "x86" engine and its
    default qconfig mapping): deprecated in PyTorch, still what many scripts use. Its symbolic tracer
    refuses models whose Python code it cannot trace (an error row then, with the tracer's reason)."""
    import torch
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = "x86"
    names = list(inputs)
    args = tuple(inputs[k] for k in names)
    prepared = prepare_fx(_positional(model, names), get_default_qconfig_mapping("x86"), args)
    with torch.no_grad():
        for item in calib:
            prepared(*(item[k] for k in names))
    q = convert_fx(prepared)
    return lambda: q(*args)


def _openvino_int8(model, inputs, calib):
    import nncf
    import openvino as ov
    import torch

    names = list(inputs)
    args = tuple(inputs[k] for k in names)
    with torch.no_grad():
        ovm = ov.convert_model(_positional(model, names), example_input=args)
    ds = nncf.Dataset([tuple(item[k].numpy() for k in names) for item in calib])
    qm = nncf.quantize(ovm, ds, subset_size=len(calib),
                       model_type=nncf.ModelType.TRANSFORMER if "input_ids" in inputs else None)
    compiled = ov.Core().compile_model(qm, "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                    "INFERENCE_NUM_THREADS": torch.get_num_threads()})
    feed = [inputs[k].numpy() for k in names]

    def run():
        return torch.from_numpy(compiled(feed)[0])
    return run


def _onnxruntime(model, inputs, calib, mode: str):
    """ONNX Runtime (``pip install onnx onnxruntime``) on the model exported with torch's TorchScript
    exporter (opset 17; shared/KNOWN.md): ``mode`` "fp32"; "dynamic" (``quantize_dynamic``: int8
    weights, activations quantized per call, MatMulIntegerToFloat on BERT); "static"
    (``quantize_static``, QDQ, uint8 activations calibrated on ``calib`` x int8 per-channel weights,
    the U8S8 form ORT recommends for x86; its S8S8 per-tensor default is no faster than fp32 there)."""
    import shutil
    import tempfile

    import onnxruntime as ort
    import torch
    from onnxruntime import quantization as oq

    names = list(inputs)
    tmp = tempfile.mkdtemp(prefix="cpu_opt_ort_")
    path = os.path.join(tmp, "model.onnx")
    with torch.no_grad():
        torch.onnx.export(_positional(model, names), tuple(inputs[k] for k in names), path, input_names=names,
                          output_names=["out"], dynamo=False, opset_version=17)
    if mode == "dynamic":
        qpath = os.path.join(tmp, "model_int8.onnx")
        oq.quantize_dynamic(path, qpath, weight_type=oq.QuantType.QInt8)
        path = qpath
    elif mode == "static":
        # ONNX Runtime's documented first step: its graph optimizations (BatchNorm folded into the
        # convolutions, shapes inferred) before the QDQ pairs go in
        from onnxruntime.quantization.shape_inference import quant_pre_process

        pre = os.path.join(tmp, "model_pre.onnx")
        quant_pre_process(path, pre)
        path = pre

        class Reader(oq.CalibrationDataReader):
            def __init__(self):
                self.items = iter([{k: item[k].numpy() for k in names} for item in calib])

            def get_next(self):
                return next(self.items, None)

        qpath = os.path.join(tmp, "model_int8.onnx")
        oq.quantize_static(path, qpath, Reader(), quant_format=oq.QuantFormat.QDQ, per_channel=True,
                           activation_type=oq.QuantType.QUInt8, weight_type=oq.QuantType.QInt8)
        path = qpath
    elif mode != "fp32":
        raise ValueError(f"ONNX Runtime mode {mode!r}: fp32, dynamic or static")
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    shutil.rmtree(tmp, ignore_errors=True)   # the session holds the model now
    feed = {k: inputs[k].numpy() for k in names}

    def run():
        return torch.from_numpy(sess.run(None, feed)[0])
    return run


def build_model(name: str, quick: bool = False, batch: int = 1):
    """A full-size (or with ``quick`` a small) random-weight model and its example inputs at ``batch``."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    if name == "bert":
        cfg = T.BertConfig() if not quick else T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                              intermediate_size=128, vocab_size=1000)
        m = T.BertModel(cfg)
        mask = torch.ones(1, 128, dtype=torch.long)
        mask[0, 100:] = 0  # a padded sequence: the mask matters
        inputs = {"input_ids": torch.randint(0, cfg.vocab_size, (1, 128)), "attention_mask": mask}
    elif name == "gpt2":
        cfg = T.GPT2Config(use_cache=False) if not quick else T.GPT2Config(n_layer=2, n_embd=64, n_head=4,
                                                                           vocab_size=1000, use_cache=False)
        m = T.GPT2LMHeadModel(cfg)
        inputs = {"input_ids": torch.randint(0, cfg.vocab_size, (1, 128))}
    elif name == "vit":
        cfg = T.ViTConfig() if not quick else T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                            intermediate_size=128)
        m = T.ViTModel(cfg, add_pooling_layer=False)
        inputs = {"pixel_values": torch.randn(1, 3, 224, 224)}
    elif name == "resnet50":
        cfg = T.ResNetConfig() if not quick else T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32],
                                                                depths=[1, 1], layer_type="basic")
        m = T.ResNetModel(cfg)
        inputs = {"pixel_values": torch.randn(1, 3, 224, 224)}
    elif name == "convnext":
        cfg = T.ConvNextConfig() if not quick else T.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1])
        m = T.ConvNextModel(cfg)
        inputs = {"pixel_values": torch.randn(1, 3, 224, 224)}
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    if batch != 1:  # token ids drawn again per row; the padding mask and pixel rows repeated
        g = torch.Generator().manual_seed(1)
        inputs = {k: torch.randint(0, cfg.vocab_size, (batch, v.shape[1]), generator=g) if k == "input_ids"
                  else torch.cat([v] * batch) if k == "attention_mask" else torch.randn((batch, *v.shape[1:]), generator=g)
                  for k, v in inputs.items()}
    return m.eval(), inputs


def _main_tensor(out):
    import torch

    if torch.is_tensor(out):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return _main_tensor(out[0])
    raise TypeError(type(out).__name__)


def worker(impl: str, name: str, repeats: int, quick: bool, batch: int = 1) -> dict:
    """One implementation of one model, in this process: build, check, time."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from bench.optimize import openvino_compile
    from cpu_opt.platform.timing import measure

    model, inputs = build_model(name, quick, batch)
    with torch.no_grad():
        ref = _main_tensor(model(**inputs))
    t0 = time.perf_counter()
    if impl == "eager":
        fn = lambda: model(**inputs)  # noqa: E731
    elif impl == "compile":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
        c = torch.compile(model, dynamic=False)
        fn = lambda: c(**inputs)  # noqa: E731
    elif impl == "cpu_opt":
        import cpu_opt

        o = cpu_opt.optimize(model, inputs, dtype="fp32")
        fn = lambda: o(**inputs)  # noqa: E731
    elif impl == "openvino":
        ov = openvino_compile(model, inputs, "fp32")
        fn = lambda: ov(**inputs)  # noqa: E731
    elif impl in ("eager_bf16", "compile_bf16"):
        target = model
        if impl == "compile_bf16":
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True
            target = torch.compile(model, dynamic=False)

        def fn():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return target(**inputs)
    elif impl == "cpu_opt_bf16":
        import cpu_opt

        o = cpu_opt.optimize(model, inputs, dtype="bf16")
        fn = lambda: o(**inputs)  # noqa: E731
    elif impl == "openvino_bf16":
        ov = openvino_compile(model, inputs, "bf16")
        fn = lambda: ov(**inputs)  # noqa: E731
    elif impl == "cpu_opt_int8":
        import cpu_opt

        o = cpu_opt.optimize(model, inputs, dtype="int8", calibration_data=calibration_inputs(name, inputs))
        fn = lambda: o(**inputs)  # noqa: E731
    elif impl == "torchao_int8":
        fn = _torchao_int8(model, inputs, calibration_inputs(name, inputs))
    elif impl == "dynamic_int8":
        qm = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        fn = lambda: qm(**inputs)  # noqa: E731
    elif impl == "openvino_int8":
        fn = _openvino_int8(model, inputs, calibration_inputs(name, inputs))
    elif impl == "fx_int8":
        fn = _fx_int8(model, inputs, calibration_inputs(name, inputs))
    elif impl == "onnxruntime":
        fn = _onnxruntime(model, inputs, None, "fp32")
    elif impl in ("ort_dynamic_int8", "ort_static_int8"):
        fn = _onnxruntime(model, inputs, calibration_inputs(name, inputs), impl.split("_")[1])
    else:
        raise ValueError(impl)
    with torch.no_grad():
        out = fn()
        build_s = time.perf_counter() - t0
        out = out if torch.is_tensor(out) else _main_tensor(out)
        cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
        # int8 and bf16 cosines are against eager fp32
        st = measure({impl: fn}, warmup=2, repeats=repeats)[impl]
    res = {"impl": impl, "model": name, "batch": batch, "median_ms": st.median * 1e3, "spread": st.spread, "build_s": build_s,
           "cosine_vs_eager": cos, "threads": torch.get_num_threads()}
    if impl in ("cpu_opt", "cpu_opt_int8", "cpu_opt_bf16"):
        rep = o.report()
        if impl == "cpu_opt_int8":
            res.update(int8_layers=len(rep.get("int8", [])),
                       int8_families=sorted({li["family"] for li in rep.get("int8", [])}))
        res.update(partitions=rep["num_partitions"], fallbacks=len(rep["fallbacks"]),
                   validation_ok=(rep["validation"] or {}).get("ok"))
    return res


def main(quick: bool = False, argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench hf")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--impls", default=None, help=f"default {','.join(IMPLS)}; with --int8 {','.join(INT8_IMPLS)}; "
                                                  f"also {','.join(OPTIONAL_IMPLS)}")
    ap.add_argument("--int8", action="store_true", help="the int8 comparison (results in hf_int8_<cpu>.json)")
    ap.add_argument("--bf16", action="store_true", help="the bf16 comparison (results in hf_bf16_<cpu>.json; for CPUs "
                                                        "with native bf16: AVX512_BF16 or AMX)")
    ap.add_argument("--batch", type=int, default=1, help="batch size of every model's input (default 1)")
    ap.add_argument("--tag", default="", help="a suffix for the result files (a partial re-run beside the full table)")
    ap.add_argument("--rounds", type=int, default=2 if quick else 3)
    ap.add_argument("--repeats", type=int, default=5 if quick else 10)
    ap.add_argument("--worker", nargs=2, metavar=("IMPL", "MODEL"), help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args(argv or [])
    quick = quick or "--quick" in (argv or [])
    if args.int8 and args.bf16:
        raise SystemExit("python -m bench hf: --int8 and --bf16 are two comparisons; run one at a time")
    kind = "int8" if args.int8 else "bf16" if args.bf16 else "fp32"
    impls = (args.impls or ",".join({"int8": INT8_IMPLS, "bf16": BF16_IMPLS, "fp32": IMPLS}[kind])).split(",")
    unknown = sorted(set(i for i in impls if i) - set(IMPLS + INT8_IMPLS + BF16_IMPLS + OPTIONAL_IMPLS))
    if unknown:
        raise SystemExit(f"python -m bench hf: unknown implementation(s) {unknown}; choose from "
                         f"{sorted(set(IMPLS + INT8_IMPLS + BF16_IMPLS + OPTIONAL_IMPLS))}")
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], args.worker[1], args.repeats, quick, args.batch)), flush=True)
        return
    from bench.runner import RESULTS_DIR, Report, bar_chart, bench_lock, machine_slug

    if args.batch < 1:
        raise SystemExit(f"python -m bench hf: --batch must be >= 1, got {args.batch}")
    # one file per CPU (and batch): the tables measured on other machines stay beside it
    stem = ("hf" if kind == "fp32" else f"hf_{kind}") + (f"_b{args.batch}" if args.batch != 1 else "")
    rep = Report(f"{stem}_{machine_slug()}" + (f"_{args.tag}" if args.tag else "") + ("_quick" if quick else ""),
                 rounds=args.rounds,
                 repeats=args.repeats, batch=args.batch,
                 protocol="each implementation in its own process, alternating rounds; median of process medians")
    results: dict = {}
    for name in [m for m in args.models.split(",") if m]:
        for rnd in range(args.rounds):
            for impl in [i for i in impls if i]:
                cmd = [sys.executable, "-m", "bench", "hf", "--worker", impl, name, "--repeats", str(args.repeats),
                       "--batch", str(args.batch)]
                if quick:
                    cmd.append("--quick")
                with bench_lock():  # per process: shorter benchmarks can run between two of them
                    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=3600)
                line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    err = (r.stderr.strip().splitlines() or ["no output"])[-1][:200]
                    if "No module named" in err:  # a peer runtime missing: say how to get it
                        err += (" (the peers are not in `make setup`: pip install -e '.[compare]'; torchao: "
                                "pip install torchao --no-deps)")
                    print(f"{name} {impl} round {rnd}: FAILED {err}", flush=True)
                    results.setdefault((name, impl), []).append({"error": err})
                    continue
                res = json.loads(line[len("RESULT "):])
                print(f"{name} {impl} round {rnd}: {res['median_ms']:.1f} ms (build {res['build_s']:.1f} s, "
                      f"cos {res['cosine_vs_eager']:.6f})", flush=True)
                results.setdefault((name, impl), []).append(res)
    for (name, impl), runs in results.items():
        ok = [r for r in runs if "error" not in r]
        row = {"model": name, "impl": impl}
        if not ok:
            row["error"] = runs[0]["error"]
        else:
            row.update(median_ms=statistics.median(r["median_ms"] for r in ok),
                       round_ms=[round(r["median_ms"], 1) for r in ok], build_s=statistics.median(r["build_s"] for r in ok),
                       cosine_vs_eager=min(r["cosine_vs_eager"] for r in ok))
            for k in ("partitions", "fallbacks", "validation_ok", "int8_layers", "int8_families"):
                if k in ok[0]:
                    row[k] = ok[0][k]
        rep.add(**row)
    by = {(r["model"], r["impl"]): r.get("median_ms") for r in rep.rows}
    for r in rep.rows:
        if r.get("median_ms"):
            for base in ("eager", "compile", "openvino", "compile_bf16", "openvino_bf16"):
                if by.get((r["model"], base)):
                    r[f"vs_{base}"] = by[(r["model"], base)] / r["median_ms"]
    rep.print_table(["model", "impl", "median_ms", "round_ms", "vs_eager", "vs_compile", "vs_openvino",
                     *(["vs_compile_bf16", "vs_openvino_bf16"] if kind == "bf16" else []), "build_s",
                     "cosine_vs_eager", "partitions", "fallbacks", "int8_families", "error"])
    models = list(dict.fromkeys(r["model"] for r in rep.rows))
    impls = list(dict.fromkeys(r["impl"] for r in rep.rows))
    bar_chart(RESULTS_DIR / f"{rep.name}.png", models,
              {i: [(by.get((m, "eager")) or 0) / (by.get((m, i)) or float("inf")) for m in models] for i in impls},
              ylabel="speedup over eager fp32 (x)",
              title=f"Hugging Face models, batch {args.batch}, {kind}, "
                    f"{rep.meta.get('threads', '?')} threads (own processes)")
    rep.save()


if __name__ == "__main__":
    main()
