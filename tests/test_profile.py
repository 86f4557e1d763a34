"""The measured routing profile: calibrate writes one, its winners override the table (and optimize
follows them), and a profile from another CPU, other versions or a corrupt file is ignored with a
warning. Each test gets its own empty cache directory."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import cpu_opt
from cpu_opt import hw, native, routing
from cpu_opt.platform import calibrate, profile


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CPU_OPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CPU_OPT_ROUTING_PROFILE", raising=False)
    profile.clear_cache()
    profile._WARNED.clear()
    yield tmp_path
    profile.clear_cache()


def _case(work, dtype, cls, winner, times=None):
    times = times or {winner: 1.0}
    return profile.Case(work, dtype, cls, "test shape", times, {}, winner)


def _write(cases, key=None, path=None) -> str:
    key = key or profile.current_key()
    prof = profile.Profile(key=key, cases=tuple(cases), created="2026-12-01T00:00:00+00:00", seconds=1.0,
                           path=str(path or profile.path_for(key)))
    return str(profile.save(prof))


def _other_backend(work, dtype, rows=None, choices=("onednn", "torch_onednn", "torch")):
    table = routing.table_route(work, dtype, rows=rows).backend
    return next(b for b in choices if b != table)


# ------------------------------------------------------------------ calibrate writes a profile

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_float_linear_candidates_read_cold_weight_copies_with_the_same_answers(dtype, monkeypatch):
    """Each float linear candidate cycles through weight copies (cold weights, as inside a model);
    every call of every candidate gives the same answer, whichever copy it read."""
    assert calibrate._cold_copies(torch.empty(3072, 768, dtype=torch.bfloat16)) == 8     # BERT's FFN in bf16
    assert calibrate._cold_copies(torch.empty(4096, 4096)) == 1                           # a 64 MB GEMV
    assert calibrate._cold_copies(torch.empty(8, 8)) == calibrate.MAX_COPIES
    made = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: made.append(1) or real_clone(self, *a, **k))
    built = calibrate._linear(dtype, (4, 64, 96))
    assert len(made) == calibrate.MAX_COPIES - 1
    assert "onednn" in built.fns or "onednn" in built.excluded
    assert "torch" in built.fns
    for name, fn in built.fns.items():
        first = fn().float()
        for _ in range(calibrate.MAX_COPIES + 1):
            assert torch.equal(fn().float(), first), name


def test_calibrate_writes_a_profile_that_routes_then_follow():
    prof = calibrate.calibrate(quick=True, progress=False, write=True)
    assert os.path.exists(prof.path) and prof.path == str(profile.path_for())
    assert prof.key == profile.current_key()
    loaded = profile.load()
    assert loaded is not None and loaded.path == prof.path
    specs = {(s.work, s.dtype, s.shape_class) for s in calibrate.SPECS}
    got = {(c.work, c.dtype, c.shape_class) for c in loaded.cases}
    assert got <= specs and ("linear", "fp32", "m128") in got and ("attention", "fp32", "default") in got
    assert {(w, d) for w, d, _ in got} <= profile.MEASURED
    for c in loaded.cases:
        assert c.winner in c.times_ms and all(t > 0 for t in c.times_ms.values())
        assert not set(c.times_ms) & set(c.excluded)
        r = routing.route(c.work, c.dtype, rows=profile.class_rows(c.work, c.shape_class))
        assert r.source == "measured" and r.backend == c.winner
    # fp32 candidates that ran here include cpu_opt's oneDNN and torch's kernel (fp32 is never refused)
    fp32 = loaded.case("linear", "fp32", "m128")
    assert {"onednn", "torch"} <= set(fp32.times_ms)
    # cpu_opt.gnn's Linear layers: the tall-skinny GEMM against torch's F.linear + autograd (a training step)
    gl = loaded.case("gnn_linear", "fp32", profile.DEFAULT_CLASS)
    want = {"tall_skinny", "torch"} if native.vectorized() else {"torch"}
    assert set(gl.times_ms) == want, (gl.times_ms, gl.excluded)
    assert gl.winner in want and routing.route("gnn_linear", "fp32").source == "measured"


def test_calibrate_cli_quick_json_writes_nothing(cache):
    env = dict(os.environ, CPU_OPT_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-m", "cpu_opt", "calibrate", "--quick", "--json"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["schema"] == profile.SCHEMA and d["cases"] and d["table"]
    assert {"work", "dtype", "class", "table", "measured", "times_ms"} <= set(d["table"][0])
    assert not list(cache.glob(f"{profile.FILE_PREFIX}*"))  # --quick: a smoke run, nothing written


def test_a_wrong_or_refusing_candidate_is_excluded_with_its_reason():
    built = calibrate.Built("s")
    ref = torch.ones(4)
    calibrate._admit(built, "right", lambda: (lambda: torch.ones(4)), calibrate._float_check(ref, "fp32"))
    calibrate._admit(built, "wrong", lambda: (lambda: torch.ones(4) * 1.01), calibrate._float_check(ref, "fp32"))

    def refuses():
        raise RuntimeError("could not create a primitive descriptor")

    calibrate._admit(built, "refuses", refuses, calibrate._float_check(ref, "fp32"))
    assert list(built.fns) == ["right"]
    assert built.excluded["wrong"].startswith("wrong answer: relative error")
    assert "could not create a primitive descriptor" in built.excluded["refuses"]


def test_the_table_keeps_a_case_within_the_noise_margin():
    spec = calibrate.Spec("linear", "fp32", "m128", (), ())
    table = routing.table_route("linear", "fp32", rows=128).backend
    other = _other_backend("linear", "fp32", rows=128)
    assert calibrate._winner(spec, {table: 1.05, other: 1.0}) == table
    assert calibrate._winner(spec, {table: 1.2, other: 1.0}) == other


# ------------------------------------------------------------------ a profile's winner overrides the table

class TwoLinears(nn.Module):
    """Big enough (16 rows x 1024 x 1024 = 16.8M multiply-adds a layer) that the small-GEMM rule
    does not apply and the profile's m128 case does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(1024, 1024), nn.Linear(1024, 1024)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_measured_linear_winner_overrides_the_table_in_optimize():
    winner = _other_backend("linear", "fp32", rows=128)
    _write([_case("linear", "fp32", "m128", winner, {winner: 1.0, "onednn": 2.0, "torch_onednn": 2.0, "torch": 2.0})])
    r = routing.route("linear", "fp32", rows=16)
    assert (r.backend, r.source) == (winner, "measured") and "measured here" in r.why
    # other row classes and an explicit (fixture) CPU still follow the table
    assert routing.route("linear", "fp32", rows=1).source == "table"
    assert routing.route("linear", "fp32", hw.detect(), rows=16).source == "table"
    m, x = TwoLinears().eval(), torch.randn(16, 1024)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    assert ((opt(x) - m(x)).abs().max() / m(x).abs().max()).item() < 1e-5
    rep = opt.report()
    if rep["num_partitions"] == 0 and any("runs in torch on this CPU" in p for p in rep["passes"]):
        return  # routing keeps fp32 graphs out of oneDNN here (no AVX2 under the cap)
    routes = {r["node"]: r["route"] for r in rep["routed"]}
    if winner == "onednn":
        assert not routes  # both layers lowered into oneDNN partitions
        assert any("MatMul" in p["ops"] for p in rep["partitions"])
    else:
        assert sorted(routes.values()) == [winner, winner], rep["routed"]
        assert all("measured here" in r["why"] for r in rep["routed"])


def test_a_case_calibrate_never_measures_is_refused():
    """fp32 convolutions and activation matmuls stay where the table puts them: moved out of their
    oneDNN partition on a bare-op timing they lose the fusion around them (calibrate.py's docstring)."""
    _write([_case("conv", "fp32", "default", "torch", {"torch": 1.0, "onednn": 2.0})])
    _assert_ignored("not a kind of work a profile routes")
    assert routing.route("conv", "fp32").source == "table"


class Attn(nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v) * 2


def test_measured_attention_winner_replaces_sdpa():
    _write([_case("attention", "fp32", "default", "matmul_softmax", {"matmul_softmax": 1.0, "torch_flash": 2.0})])
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    m = Attn().eval()
    opt = cpu_opt.optimize(m, (q, k, v), dtype="fp32")
    assert any("routed to matmul softmax" in p for p in opt.report()["passes"])
    assert ((opt(q, k, v) - m(q, k, v)).abs().max()).item() < 1e-5


# ------------------------------------------------------------------ untrusted profiles are ignored, with a warning

def _assert_ignored(match):
    with pytest.warns(RuntimeWarning, match=match):
        assert profile.load() is None
    assert routing.route("linear", "fp32", rows=128).source == "table"


def test_profile_from_another_cpu_is_ignored_with_a_warning():
    key = dict(profile.current_key(), cpu="Some Other CPU", isa=["sse4_1"])
    winner = _other_backend("linear", "fp32", rows=128)
    _write([_case("linear", "fp32", "m128", winner)], key=key, path=profile.path_for())  # e.g. a copied file
    _assert_ignored("another machine or with other versions.*cpu: profile 'Some Other CPU'")


def test_profile_for_other_versions_or_threads_is_ignored_with_a_warning(cache):
    for field, value in (("torch", "2.99.0"), ("onednn", "9.9.9"), ("threads", 97)):
        profile.clear_cache()
        profile._WARNED.clear()
        for f in cache.glob("*"):
            f.unlink()
        key = dict(profile.current_key(), **{field: value})
        _write([_case("linear", "fp32", "m128", "torch")], key=key)  # under its own key's file name
        _assert_ignored(f"{field}: profile {value!r}")


def test_corrupt_or_foreign_schema_profile_is_ignored_with_a_warning():
    path = profile.path_for()
    path.parent.mkdir(parents=True, exist_ok=True)
    for text, match in (("{not json", "JSONDecodeError"), (json.dumps({"schema": 99}), "schema 99"),
                        (json.dumps({"schema": profile.SCHEMA, "key": profile.current_key(),
                                     "cases": [{"work": "linear"}]}), "malformed case"),
                        (json.dumps({"schema": profile.SCHEMA, "key": profile.current_key(),
                                     "cases": [_case("attention", "fp32", "default", "matmul_softmax",
                                                     {"torch_flash": 1.0}).__dict__]}),
                         "was not timed")):
        path.write_text(text)
        profile.clear_cache()
        profile._WARNED.clear()
        _assert_ignored(match)


def test_explicit_profile_path_must_match_this_machine(tmp_path, monkeypatch):
    other = tmp_path / "shipped.json"
    _write([_case("linear", "fp32", "m128", "torch")], key=dict(profile.current_key(), cpu="elsewhere"), path=other)
    monkeypatch.setenv("CPU_OPT_ROUTING_PROFILE", str(other))
    profile.clear_cache()
    _assert_ignored("elsewhere")
    _write([_case("linear", "fp32", "m128", "torch")], path=other)  # this machine's key: trusted
    profile.clear_cache()
    assert routing.route("linear", "fp32", rows=128).source == "measured"


def test_nothing_is_measured_without_a_profile(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("measured behind the user's back")

    monkeypatch.setattr(calibrate, "measure", boom)
    monkeypatch.setattr(calibrate, "calibrate", boom)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning either: an empty cache is the normal case
        assert profile.load() is None
        for work in routing.WORK_KINDS:
            assert routing.route(work, "fp32").source == "table"
    m, x = TwoLinears().eval(), torch.randn(8, 1024)
    cpu_opt.optimize(m, x, dtype="fp32")


def test_info_json_shows_table_and_measured_routes(cache):
    winner = _other_backend("linear", "fp32", rows=128)
    loser = next(b for b in ("onednn", "torch_onednn", "torch") if b != winner)
    path = _write([_case("linear", "fp32", "m128", winner, {winner: 1.0, loser: 3.0}),
                   _case("attention", "fp32", "default", "torch_flash", {"torch_flash": 1.0, "matmul_softmax": 1.5})])
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_OPT_MAX_ISA", "ONEDNN_MAX_CPU_ISA")}
    env.update(CPU_OPT_CACHE_DIR=str(cache))
    for var in ("CPU_OPT_MAX_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        if var in os.environ:
            env[var] = os.environ[var]  # the capped run's key must match the parent's
    r = subprocess.run([sys.executable, "-m", "cpu_opt", "info", "--json"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["profile"]["path"] == path
    lin = d["routes"]["linear"]["fp32"]
    assert lin["backend"] == winner and lin["source"] == "measured"
    assert lin["table"]["backend"] == routing.table_route("linear", "fp32").backend
    assert lin["measured"][0]["winner"] == winner and lin["measured"][0]["times_ms"][winner] == 1.0
    assert d["routes"]["gemm"]["fp32"]["measured"] == [] and d["routes"]["gemm"]["fp32"]["source"] == "table"
    text = subprocess.run([sys.executable, "-m", "cpu_opt", "info"], capture_output=True, text=True, env=env,
                          timeout=120).stdout
    assert path in text and winner in text and "measured" in text


def test_row_classes():
    assert [profile.row_class(r) for r in (1, 3, 4, 511, 512, 10 ** 6, None)] == \
        ["gemv", "gemv", "m128", "m128", "m2048", "m2048", "m128"]
    assert profile.row_class(routing.LINEAR_TORCH_MIN_ROWS - 1) == "gemv"
    assert profile.row_class(routing.LINEAR_TORCH_MIN_ROWS) == "m128"


def test_int8_candidates_are_checked_for_saturation(monkeypatch):
    """With 8-bit activations every x86 int8 kernel without VNNI saturates u8 x s8 pairs in int16
    (20% wrong here): the check excludes them. With VNNI, oneDNN's kernels are exact. calibrate itself
    uses 7-bit activations where the CPU has no VNNI, so it has right candidates on both sides."""
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(calibrate, "_int8_inputs",
                        lambda shape, gen: (torch.randint(0, 256, shape, dtype=torch.uint8, generator=g), 256))
    built = calibrate._linear_int8((16, 256, 64))
    if hw.has_vnni(hw.detect()):
        assert {"onednn", "torch_onednn"} <= set(built.fns), built.excluded
    elif "avx512_vnni" in hw.detect().isa_uncapped:
        # capped below VNNI on a VNNI CPU: both oneDNNs obey the cap and saturate; FBGEMM cannot be
        # capped (it reads CPUID) and stays exact
        assert set(built.fns) == {"fbgemm"}, (built.fns, built.excluded)
        assert all(w.startswith("wrong answer") for w in built.excluded.values()), built.excluded
    else:
        assert not built.fns and all(w.startswith("wrong answer") for w in built.excluded.values()), built.excluded
    monkeypatch.undo()
    seven_bit = calibrate._linear_int8((16, 256, 64))
    assert seven_bit.fns and "bit activations" in seven_bit.shape
    assert ("8-bit" in seven_bit.shape) == hw.has_vnni(hw.detect())
