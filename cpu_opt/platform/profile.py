"""The measured routing profile: what ``python -m cpu_opt calibrate`` found fastest on this machine.

A profile holds, for each case it timed (work kind, dtype, shape class), every candidate backend's
median time and the winner. It is keyed by what decides kernel speed — the CPU model, family and
model numbers, the ISA set in force (after any cap), torch's and libdnnl's versions and the thread
count — and kept as one JSON file per key under the cache directory (``CPU_OPT_CACHE_DIR``, else
``$XDG_CACHE_HOME/cpu_opt``, else ``~/.cache/cpu_opt``), so machines sharing a home directory keep
their own. Where this machine's profile has a case, its winner overrides the routing table's rule
(:func:`cpu_opt.routing.route`).

A profile is trusted only if it parses, has this schema version, and its key equals this
process's key: a corrupt file, or one from another CPU or other library versions (a copied cache
directory, ``CPU_OPT_ROUTING_PROFILE`` pointing at another machine's file), is ignored with a
``RuntimeWarning`` and the table decides. Nothing is measured unless asked: without a profile, the
table alone routes.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

SCHEMA = 1
FILE_PREFIX = "routing-profile-"

# Shape classes of the work that depends on the row count (linear layers): a profile measures one
# representative shape per class and a layer takes the class of its activation rows.
ROW_CLASSES = (("gemv", 4), ("m128", 512), ("m2048", None))  # (class, rows below which it applies)
DEFAULT_CLASS = "default"
# What a profile may route: the work calibrate measures on its own (calibrate.py says why fp32/bf16
# convolutions and activation matmuls are not among them). A case outside this set is refused.
MEASURED = {("linear", "fp32"), ("linear", "bf16"), ("linear", "int8"), ("conv", "int8"),
            ("attention", "fp32"), ("attention", "bf16"), ("gnn_linear", "fp32")}
REPRESENTATIVE_ROWS = {"gemv": 1, "m128": 128, "m2048": 2048}  # the rows calibrate measures each class at


def class_rows(work: str, shape_class: str) -> int | None:
    """The representative row count of a case (``None`` for work without row classes)."""
    return REPRESENTATIVE_ROWS.get(shape_class) if work == "linear" else None


def row_class(rows: int | None) -> str:
    """The shape class of a GEMM with ``rows`` activation rows (``None``: the representative m128)."""
    if rows is None:
        return "m128"
    for name, below in ROW_CLASSES:
        if below is None or rows < below:
            return name
    return ROW_CLASSES[-1][0]


def cache_dir() -> Path:
    env = os.environ.get("CPU_OPT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cpu_opt"


def current_key() -> dict:
    """What a profile must have been measured with to apply in this process."""
    import torch

    from . import hw

    info = hw.detect()
    try:
        from ..dnnl import version

        onednn = version()
    except Exception:  # noqa: BLE001 - no binding (aarch64, or not installed)
        onednn = None
    return {
        "cpu": info.model_name, "vendor": info.vendor, "family": info.family, "model": info.model,
        "arch": info.arch, "isa": sorted(info.isa), "isa_cap": info.isa_cap,
        "torch": torch.__version__, "onednn": onednn, "threads": torch.get_num_threads(),
    }


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def path_for(key: dict | None = None) -> Path:
    return cache_dir() / f"{FILE_PREFIX}{key_digest(key or current_key())}.json"


@dataclass(frozen=True)
class Case:
    work: str
    dtype: str
    shape_class: str
    shape: str
    times_ms: dict          # backend -> median ms (candidates that ran and were right)
    excluded: dict          # backend -> why it was not a candidate (refused, wrong answers)
    winner: str

    def figures(self) -> str:
        return ", ".join(f"{b} {t:.3g} ms" for b, t in sorted(self.times_ms.items(), key=lambda kv: kv[1]))


@dataclass(frozen=True)
class Profile:
    key: dict
    cases: tuple
    created: str
    seconds: float
    path: str

    def case(self, work: str, dtype: str, shape_class: str) -> Case | None:
        for c in self.cases:
            if (c.work, c.dtype, c.shape_class) == (work, dtype, shape_class):
                return c
        return None

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "key": self.key, "created": self.created, "seconds": self.seconds,
                "cases": [c.__dict__ for c in self.cases]}


class ProfileError(ValueError):
    """A profile file that cannot be trusted (unreadable, another schema, another machine)."""


def parse(data, path: str = "<memory>", key: dict | None = None) -> Profile:
    """Validate ``data`` (a decoded profile file) against ``key`` (default: this process)."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ProfileError(f"schema {data.get('schema') if isinstance(data, dict) else None!r}, expected {SCHEMA}")
    want = key or current_key()
    got = data.get("key")
    if got != want:
        diff = sorted(k for k in set(want) | set(got or {}) if (got or {}).get(k) != want.get(k))
        detail = "; ".join(f"{k}: profile {(got or {}).get(k)!r}, here {want.get(k)!r}" for k in diff[:4])
        raise ProfileError(f"measured on another machine or with other versions ({detail})")
    cases = []
    for raw in data.get("cases", []):
        try:
            c = Case(work=str(raw["work"]), dtype=str(raw["dtype"]), shape_class=str(raw["shape_class"]),
                     shape=str(raw["shape"]), times_ms={str(b): float(t) for b, t in raw["times_ms"].items()},
                     excluded={str(b): str(w) for b, w in raw.get("excluded", {}).items()},
                     winner=str(raw["winner"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"malformed case {raw!r}: {type(e).__name__}: {e}") from None
        if (c.work, c.dtype) not in MEASURED:
            raise ProfileError(f"case {c.work}/{c.dtype}: not a kind of work a profile routes "
                               f"(calibrate measures {sorted(MEASURED)})")
        if c.winner not in c.times_ms:
            raise ProfileError(f"case {c.work}/{c.dtype}/{c.shape_class}: winner {c.winner!r} was not timed")
        cases.append(c)
    return Profile(key=got, cases=tuple(cases), created=str(data.get("created", "")),
                   seconds=float(data.get("seconds", 0.0)), path=path)


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


_WARNED: set = set()


def _read(path: Path, key: dict) -> Profile | None:
    try:
        data = json.loads(path.read_text())
        return parse(data, str(path), key)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ProfileError) as e:
        _warn_once(f"cpu_opt: ignoring routing profile {path}: {type(e).__name__}: {e}; the routing table "
                   "decides (re-run `python -m cpu_opt calibrate` to measure this machine)")
        return None


@functools.lru_cache(maxsize=8)
def _load(key_json: str, directory: str, explicit: str | None) -> Profile | None:
    key = json.loads(key_json)
    if explicit:
        return _read(Path(explicit), key)
    mine = Path(directory) / f"{FILE_PREFIX}{key_digest(key)}.json"
    if mine.exists():
        return _read(mine, key)
    # Profiles of other machines or versions in the same directory: say why none applies.
    for other in sorted(Path(directory).glob(f"{FILE_PREFIX}*.json")):
        _read(other, key)
    return None


def load() -> Profile | None:
    """This machine's profile, or ``None`` (no file, or none that can be trusted: warned)."""
    try:
        key = current_key()
    except Exception:  # noqa: BLE001 - torch missing: no profile
        return None
    return _load(json.dumps(key, sort_keys=True), str(cache_dir()), os.environ.get("CPU_OPT_ROUTING_PROFILE"))


def clear_cache() -> None:
    """Forget loaded profiles (after ``calibrate`` wrote one, or a test changed the directory)."""
    _load.cache_clear()


def save(profile: Profile) -> Path:
    path = Path(profile.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1))
    os.replace(tmp, path)  # never a half-written profile under the real name
    clear_cache()
    return path


def measured(work: str, dtype: str, rows: int | None = None) -> Case | None:
    """The profile's case for this work, or ``None``."""
    prof = load()
    if prof is None:
        return None
    shape_class = row_class(rows) if work == "linear" else DEFAULT_CLASS
    return prof.case(work, dtype, shape_class)
