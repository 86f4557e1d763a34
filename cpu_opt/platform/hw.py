"""Hardware detection: what this CPU can do, from several sources that are cross-checked.

``detect()`` returns a frozen :class:`CPUInfo`. Sources, in order of authority:

1. ``/proc/cpuinfo`` (Linux): the ISA flags the kernel reports. Linux clears a flag when the
   OS does not enable its register state, so AVX-512 flags are already OS-checked there.
2. py-cpuinfo: brand, caches, and the flags again (reads CPUID itself on x86).
3. torch: ``torch.backends.cpu.get_cpu_capability()`` — the kernel set ATen dispatches to.
4. For AMX, the kernel's permission interface: ``arch_prctl(ARCH_GET_XCOMP_SUPP)`` must list
   XTILEDATA, or AMX does not count (oneDNN requests the permission itself when it runs).

Where sources disagree the result carries a note in ``CPUInfo.disagreements``.

The ISA can be capped with ``CPU_OPT_MAX_ISA`` (in the spirit of ``ONEDNN_MAX_CPU_ISA``):
x86 levels ``sse41 < avx2 < avx2_vnni < avx512_core < avx512_core_vnni < avx512_core_bf16 <
avx512_core_fp16 < avx512_core_amx < all``; aarch64 levels ``asimd < sve < sve_bf16 < all``.
Features above the cap are removed from ``CPUInfo.isa`` (the uncapped set stays in
``CPUInfo.isa_uncapped``), and every route in :mod:`cpu_opt.routing` follows ``isa``.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

# x86 ISA features we report (lowercase, as Linux spells them in /proc/cpuinfo: "pni" is SSE3,
# "abm" is LZCNT). Every one of them belongs to a level of the cap below; everything else the kernel
# lists stays in CPUInfo.flags.
X86_FEATURES = (
    "pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "aes", "pclmulqdq",
    "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave", "vaes", "vpclmulqdq", "gfni",
    "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512ifma", "avx512vbmi",
    "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq", "avx512_vp2intersect",
    "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
)
AMX_FEATURES = frozenset({"amx_tile", "amx_bf16", "amx_int8", "amx_fp16"})
# Aliases seen in other sources (py-cpuinfo, older kernels) -> our names.
_X86_ALIASES = {
    "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "avxvnni": "avx_vnni", "amxtile": "amx_tile", "amxbf16": "amx_bf16", "amxint8": "amx_int8",
    "sse4.1": "sse4_1", "sse4.2": "sse4_2", "sse3": "pni", "bmi": "bmi1", "lzcnt": "abm",
    "avx512vbmi2": "avx512_vbmi2", "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
}
ARM_FEATURES = ("asimd", "asimddp", "asimdhp", "fphp", "sve", "sve2", "bf16", "i8mm", "svebf16", "svei8mm", "sme")

# Levels of the ISA cap, each with the features it allows on top of the previous level.
X86_ISA_LEVELS = {
    "sse41": {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "aes", "pclmulqdq"},
    "avx2": {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave", "vaes", "vpclmulqdq", "gfni"},
    "avx2_vnni": {"avx_vnni"},
    "avx512_core": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512ifma", "avx512vbmi",
                    "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq", "avx512_vp2intersect"},
    "avx512_core_vnni": {"avx512_vnni"},
    "avx512_core_bf16": {"avx512_bf16"},
    "avx512_core_fp16": {"avx512_fp16"},
    "avx512_core_amx": set(AMX_FEATURES),
    "all": set(),
}
ARM_ISA_LEVELS = {
    "asimd": {"asimd", "asimddp", "asimdhp", "fphp"},
    "sve": {"sve", "sve2"},
    "sve_bf16": {"bf16", "i8mm", "svebf16", "svei8mm"},
    "all": {"sme"},
}
# The ONEDNN_MAX_CPU_ISA value matching each x86 cap (oneDNN reads it once, at first use).
ONEDNN_ISA_FOR_CAP = {
    "sse41": "SSE41", "avx2": "AVX2", "avx2_vnni": "AVX2_VNNI", "avx512_core": "AVX512_CORE",
    "avx512_core_vnni": "AVX512_CORE_VNNI", "avx512_core_bf16": "AVX512_CORE_BF16",
    "avx512_core_fp16": "AVX512_CORE_FP16", "avx512_core_amx": "AVX512_CORE_AMX", "all": "ALL",
}

# ONEDNN_MAX_CPU_ISA values (oneDNN 3.x spellings) -> our level: a user who caps oneDNN directly
# caps the routes too. oneDNN's AVX (no AVX2) maps to sse41, the highest level without AVX2.
CAP_FOR_ONEDNN_ISA = {
    "SSE41": "sse41", "AVX": "sse41", "AVX2": "avx2", "AVX2_VNNI": "avx2_vnni", "AVX2_VNNI_2": "avx2_vnni",
    "AVX512_CORE": "avx512_core", "AVX512_CORE_VNNI": "avx512_core_vnni", "AVX512_CORE_BF16": "avx512_core_bf16",
    "AVX512_CORE_FP16": "avx512_core_fp16", "AVX10_1_512": "avx512_core_fp16", "AVX512_CORE_AMX": "avx512_core_amx",
    "AVX512_CORE_AMX_FP16": "avx512_core_amx", "AVX10_1_512_AMX": "avx512_core_amx",
    "AVX10_1_512_AMX_FP16": "avx512_core_amx", "DEFAULT": "all", "ALL": "all",
}

# Arm 'CPU part' (MIDR) of the implementer 0x41 (Arm Ltd) -> core name, and its usual SVE width.
ARM_CORES = {
    0xD0C: ("Neoverse N1", 0),
    0xD40: ("Neoverse V1", 256),
    0xD49: ("Neoverse N2", 128),
    0xD4F: ("Neoverse V2", 128),
    0xD8E: ("Neoverse N3", 128),
    0xD84: ("Neoverse V3", 128),
    0xD08: ("Cortex-A72", 0),
    0xD0B: ("Cortex-A76", 0),
}
# x86 (vendor, family, model) -> core name, for labels only (never for routing: routes follow features).
X86_CORES = {
    ("GenuineIntel", 6, 85): "Skylake-SP / Cascade Lake", ("GenuineIntel", 6, 106): "Ice Lake-SP",
    ("GenuineIntel", 6, 108): "Ice Lake-D", ("GenuineIntel", 6, 143): "Sapphire Rapids",
    ("GenuineIntel", 6, 207): "Emerald Rapids", ("GenuineIntel", 6, 173): "Granite Rapids",
    ("GenuineIntel", 6, 79): "Broadwell", ("GenuineIntel", 6, 63): "Haswell",
    ("AuthenticAMD", 23, 1): "Zen 1", ("AuthenticAMD", 23, 49): "Zen 2", ("AuthenticAMD", 25, 1): "Zen 3",
    ("AuthenticAMD", 25, 17): "Zen 4", ("AuthenticAMD", 25, 160): "Zen 4c",
}
X86_CORE_FAMILIES = {("AuthenticAMD", 26): "Zen 5", ("AuthenticAMD", 25): "Zen 3 / Zen 4",
                     ("AuthenticAMD", 23): "Zen / Zen 2"}
# Known deployments, to name the instance family in reports.
GRAVITON = {"Neoverse N1": "Graviton2", "Neoverse V1": "Graviton3", "Neoverse V2": "Graviton4"}


# The feature sets conditions are written with (after the cap: CPUInfo.isa).
AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})   # oneDNN's avx512_core
AVX2_FMA = frozenset({"avx2", "fma"})


def has_avx512_core(info: "CPUInfo") -> bool:
    """oneDNN's avx512_core level: from here oneDNN 3.2 *accepts* bf16 (emulated without AVX512_BF16)."""
    return info.arch == "x86_64" and AVX512_CORE <= info.isa


def has_native_bf16(info: "CPUInfo") -> bool:
    """bf16 dot products in hardware: AVX512_BF16 or AMX-BF16 on x86, BF16 on Arm — the condition
    for bf16 to be *fast*, which is not the condition for oneDNN to accept it."""
    if info.arch == "x86_64":
        return "avx512_bf16" in info.isa or "amx_bf16" in info.isa
    return "bf16" in info.isa


def has_vnni(info: "CPUInfo") -> bool:
    """u8 x s8 dot products with int32 accumulation (AVX512_VNNI, AVX-VNNI or AMX-INT8): without
    them x86 int8 kernels add pairs of products in int16 and saturate 8-bit activations."""
    return info.arch == "x86_64" and bool({"avx512_vnni", "avx_vnni", "amx_int8"} & info.isa)


class ISACapError(ValueError):
    """CPU_OPT_MAX_ISA names no known level."""


@dataclass(frozen=True)
class CPUInfo:
    arch: str                      # "x86_64" or "aarch64"
    vendor: str                    # "GenuineIntel", "AuthenticAMD", "ARM", ...
    model_name: str
    physical_cores: int
    logical_cpus: int
    # {"L1d": bytes, "L2": bytes, "L3": bytes}; read-only (detect() shares one cached instance), and left
    # out of the hash so a CPUInfo stays hashable.
    cache_sizes: MappingProxyType = field(default_factory=dict, hash=False)
    isa: frozenset = frozenset()           # features after the cap
    isa_uncapped: frozenset = frozenset()  # features the CPU and OS offer
    isa_cap: str | None = None             # the cap level in force, if any (CPU_OPT_MAX_ISA / ONEDNN_MAX_CPU_ISA)
    # every flag the kernel lists in /proc/cpuinfo (AMX ones only where the OS offers tile state),
    # known to cpu_opt or not
    flags: frozenset = frozenset()
    sve_vector_bits: int = 0               # aarch64: SVE vector length in bits (0 = no SVE)
    arm_core: str | None = None            # aarch64: "Neoverse V1" etc.
    arm_cpu_part: int | None = None
    torch_capability: str | None = None    # torch.backends.cpu.get_cpu_capability()
    family: int | None = None              # x86: CPU family / model
    model: int | None = None
    disagreements: tuple = ()              # human-readable notes where sources differ
    sources: tuple = ()                    # which sources were read

    def __post_init__(self):
        if not isinstance(self.cache_sizes, MappingProxyType):
            object.__setattr__(self, "cache_sizes", MappingProxyType(dict(self.cache_sizes or {})))

    def has(self, *features: str) -> bool:
        """True when every named feature is available (after the cap)."""
        return all(f in self.isa for f in features)

    @property
    def graviton(self) -> str | None:
        return GRAVITON.get(self.arm_core or "")

    @property
    def microarchitecture(self) -> str | None:
        """The core's name where (vendor, family, model) or the Arm part is known, e.g. "Zen 3"."""
        if self.arch == "aarch64":
            return self.arm_core
        return X86_CORES.get((self.vendor, self.family, self.model)) or \
            X86_CORE_FAMILIES.get((self.vendor, self.family))

    @property
    def label(self) -> str:
        """Model name with the microarchitecture and the family/model numbers: what benchmark
        tables and profiles name the machine by ("AMD EPYC (Zen 3, family 25 model 1)")."""
        bits = [b for b in (self.microarchitecture,) if b]
        if self.family is not None:
            bits.append(f"family {self.family} model {self.model}")
        return f"{self.model_name} ({', '.join(bits)})" if bits else self.model_name

    def to_dict(self) -> dict:
        return {
            "arch": self.arch, "vendor": self.vendor, "model_name": self.model_name,
            "physical_cores": self.physical_cores, "logical_cpus": self.logical_cpus,
            "cache_sizes": dict(self.cache_sizes), "isa": sorted(self.isa),
            "isa_uncapped": sorted(self.isa_uncapped), "isa_cap": self.isa_cap, "flags": sorted(self.flags),
            "family": self.family, "model": self.model, "microarchitecture": self.microarchitecture,
            "sve_vector_bits": self.sve_vector_bits, "arm_core": self.arm_core,
            "graviton": self.graviton, "torch_capability": self.torch_capability,
            "disagreements": list(self.disagreements), "sources": list(self.sources),
        }


# ----------------------------------------------------------------------------- parsing

def parse_proc_cpuinfo(text: str) -> dict:
    """Parse /proc/cpuinfo text into a summary dict (works on x86 and aarch64 layouts)."""
    blocks = [b for b in re.split(r"\n\s*\n", text.strip()) if b.strip()]
    procs = []
    for b in blocks:
        d = {}
        for line in b.splitlines():
            if ":" not in line:
                continue
            k, v = line.split(":", 1)
            d[k.strip().lower()] = v.strip()
        if d:
            procs.append(d)
    first = next((p for p in procs if "processor" in p), procs[0] if procs else {})
    flags_text = first.get("flags") or first.get("features") or ""
    flags = {_X86_ALIASES.get(f, f) for f in flags_text.split()}
    cores = {(p.get("physical id", "0"), p.get("core id", p.get("processor"))) for p in procs if "processor" in p}
    n_logical = sum(1 for p in procs if "processor" in p)
    is_arm = "cpu implementer" in first or "features" in first and "flags" not in first
    out = {
        "arch": "aarch64" if is_arm else "x86_64",
        "flags": flags,
        "raw_flags": set(flags_text.split()),
        "logical": n_logical,
        "physical": len(cores) if not is_arm else n_logical,
        "vendor": first.get("vendor_id", ""),
        "model_name": first.get("model name", ""),
        "cache_size": first.get("cache size"),
    }
    if not is_arm:
        # 'cpu cores' is per socket; physical id x core id already counts real cores.
        for key in ("cpu family", "model"):
            try:
                out[key.replace("cpu ", "")] = int(first.get(key, ""))
            except ValueError:
                pass
    else:
        impl = first.get("cpu implementer", "")
        part = first.get("cpu part", "")
        out["implementer"] = int(impl, 16) if impl.startswith("0x") else None
        out["cpu_part"] = int(part, 16) if part.startswith("0x") else None
        out["vendor"] = "ARM" if out["implementer"] == 0x41 else (impl or "unknown")
    return out


def _x86_features(flags: set) -> set:
    return {f for f in X86_FEATURES if f in flags}


def _arm_features(flags: set) -> set:
    return {f for f in ARM_FEATURES if f in flags}


def apply_isa_cap(arch: str, features: set, cap: str | None) -> set:
    """Remove every feature above ``cap``; ``None`` or ``"all"`` keeps everything."""
    cap_l = normalize_isa_cap(cap)
    if cap_l is None:
        return set(features)
    levels = X86_ISA_LEVELS if arch == "x86_64" else ARM_ISA_LEVELS
    if cap_l not in levels:
        raise ISACapError(
            f"CPU_OPT_MAX_ISA={cap!r} is not a known {arch} level; expected one of {', '.join(levels)}")
    allowed = set()
    for name, feats in levels.items():
        allowed |= feats
        if name == cap_l:
            break
    allowed -= _OFF_BRANCH.get(cap_l, set())
    known = set().union(*levels.values())
    return {f for f in features if f in allowed or f not in known}


# Levels that are not a superset of every level listed before them: oneDNN's AVX512_CORE does not
# include AVX2_VNNI (avx2_vnni is a side branch of its ISA tree), so under that cap neither oneDNN nor
# cpu_opt may count on AVX-VNNI (on a Xeon with AMX, 8-bit activations then saturated oneDNN's kernels).
_OFF_BRANCH = {"avx512_core": {"avx_vnni"}}


def normalize_isa_cap(cap: str | None) -> str | None:
    """The cap as the level tables spell it (lowercase, trimmed); ``None`` for no cap."""
    cap_l = (cap or "").strip().lower()
    return cap_l or None


def isa_cap_from_env() -> str | None:
    """The cap in force: ``CPU_OPT_MAX_ISA``, or on x86 a ``ONEDNN_MAX_CPU_ISA`` (or the older
    ``DNNL_MAX_CPU_ISA``) the user set, mapped to our levels; the lower of the two when both are set.
    oneDNN obeys its own variable whatever we do, so routes that ignored it would send work to
    kernels oneDNN no longer has (bf16 graphs below avx512_core abort inside oneDNN 3.2)."""
    ours = normalize_isa_cap(os.environ.get("CPU_OPT_MAX_ISA"))
    theirs = _onednn_cap_from_env()
    if theirs is None or theirs == "all":
        return ours
    if ours is None or ours == "all":
        return theirs
    levels = list(X86_ISA_LEVELS)
    if ours not in levels:
        return ours  # build_info names the bad value
    return ours if levels.index(ours) <= levels.index(theirs) else theirs


def isa_cap_source() -> str | None:
    """Which variable the cap in force comes from (``None`` without a cap)."""
    cap = isa_cap_from_env()
    if cap is None:
        return None
    return "CPU_OPT_MAX_ISA" if normalize_isa_cap(os.environ.get("CPU_OPT_MAX_ISA")) == cap else "ONEDNN_MAX_CPU_ISA"


def _onednn_cap_from_env() -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None  # on aarch64 oneDNN's levels (SVE_256 ...) are torch's business
    raw = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if not raw:
        return None
    level = CAP_FOR_ONEDNN_ISA.get(raw)
    if level is None:
        import warnings

        warnings.warn(f"ONEDNN_MAX_CPU_ISA={raw!r} is not a oneDNN 3.x ISA name cpu_opt knows; "
                      "routes ignore it", RuntimeWarning, stacklevel=3)
    return level


# The MKL_ENABLE_INSTRUCTIONS value for each cap (MKL runs torch's fp32 GEMMs): None leaves MKL alone.
MKL_ISA_FOR_CAP = {
    "sse41": "SSE4_2", "avx2": "AVX2", "avx2_vnni": "AVX2", "avx512_core": "AVX512",
    "avx512_core_vnni": "AVX512_E1", "avx512_core_bf16": "AVX512_E1", "avx512_core_fp16": "AVX512_E1",
    "avx512_core_amx": None, "all": None,
}


def export_cap() -> None:
    """Give the kernel libraries the level of ``CPU_OPT_MAX_ISA``, unless the user set their own
    variables: ``ONEDNN_MAX_CPU_ISA`` for cpu_opt's libdnnl and the oneDNN inside torch (both read
    it once, at their first primitive) and ``MKL_ENABLE_INSTRUCTIONS`` for MKL (torch's fp32 GEMMs).
    Called at ``import cpu_opt`` (the libraries inside torch are capped only if nothing ran in them
    before; set the variables before starting Python to be sure) and again when libdnnl loads.
    FBGEMM and torch's own ATen kernels have no such switch after start-up (ATen reads
    ``ATEN_CPU_CAPABILITY`` when torch loads)."""
    cap = normalize_isa_cap(os.environ.get("CPU_OPT_MAX_ISA"))
    if not cap or platform.machine() not in ("x86_64", "AMD64"):
        return
    if cap in ONEDNN_ISA_FOR_CAP and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        os.environ["ONEDNN_MAX_CPU_ISA"] = ONEDNN_ISA_FOR_CAP[cap]
    if MKL_ISA_FOR_CAP.get(cap) and "MKL_ENABLE_INSTRUCTIONS" not in os.environ:
        os.environ["MKL_ENABLE_INSTRUCTIONS"] = MKL_ISA_FOR_CAP[cap]


# ----------------------------------------------------------------------------- live probes

def _amx_os_enabled() -> bool | None:
    """Does the kernel support AMX tile state? None where it cannot be asked (not x86 Linux)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_uint64(0)
        SYS_arch_prctl, ARCH_GET_XCOMP_SUPP = 158, 0x1021
        # syscall() is variadic: pass full-width longs, not ctypes' default C int.
        if libc.syscall(ctypes.c_long(SYS_arch_prctl), ctypes.c_long(ARCH_GET_XCOMP_SUPP), ctypes.byref(mask)) != 0:
            return False
        return bool(mask.value & (1 << 18))  # XFEATURE_XTILEDATA
    except Exception:
        return None


def _sve_vector_bits_live() -> int | None:
    """SVE vector length of this process, via prctl(PR_SVE_GET_VL); None where not available."""
    if platform.system() != "Linux" or platform.machine() != "aarch64":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SVE_GET_VL = 51
        zero = ctypes.c_ulong(0)
        r = libc.prctl(ctypes.c_int(PR_SVE_GET_VL), zero, zero, zero, zero)
        if r < 0:
            return None
        return (r & 0xFFFF) * 8
    except Exception:
        return None


def _sysfs_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict:
    caches = {}
    try:
        for idx in sorted(root.glob("index*")):
            level = (idx / "level").read_text().strip()
            ctype = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
            m = re.match(r"(\d+)([KMG]?)", size)
            if not m:
                continue
            n = int(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)]
            name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(ctype, "")
            caches[name] = n
    except OSError:
        pass
    return caches


def _torch_capability() -> str | None:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        return None


def _pycpuinfo() -> dict | None:
    if os.environ.get("CPU_OPT_NO_PYCPUINFO"):
        return None
    try:
        import cpuinfo

        return cpuinfo.get_cpu_info()
    except Exception:
        return None


# ----------------------------------------------------------------------------- assembly

_TORCH_CAP_NEEDS = {"AVX512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "AVX2": {"avx2", "fma"},
                    "SVE256": {"sve"}, "SVE": {"sve"}}


def build_info(cpuinfo_text: str, *, pycpuinfo: dict | None = None, torch_capability: str | None = None,
               amx_os_enabled: bool | None = None, sve_vector_bits: int | None = None,
               caches: dict | None = None, cap: str | None = None) -> CPUInfo:
    """Assemble a :class:`CPUInfo` from explicit source data (what :func:`detect` reads live;
    tests pass fixture texts)."""
    p = parse_proc_cpuinfo(cpuinfo_text)
    arch = p["arch"]
    notes = []
    sources = ["/proc/cpuinfo"]
    if arch == "x86_64":
        feats = _x86_features(p["flags"])
    else:
        feats = _arm_features(p["flags"])

    if pycpuinfo:
        sources.append("py-cpuinfo")
        pf = {_X86_ALIASES.get(f, f) for f in pycpuinfo.get("flags", [])}
        other = _x86_features(pf) if arch == "x86_64" else _arm_features(pf)
        if other and other != feats:
            only_proc, only_py = sorted(feats - other), sorted(other - feats)
            notes.append(f"py-cpuinfo and /proc/cpuinfo differ: only /proc/cpuinfo {only_proc}, "
                         f"only py-cpuinfo {only_py}; /proc/cpuinfo wins (it reflects OS support)")

    flags = set(p["raw_flags"])
    if arch == "x86_64" and feats & AMX_FEATURES:
        if amx_os_enabled is False:
            notes.append("CPU reports AMX but the kernel does not offer AMX tile state; AMX not counted")
            feats -= AMX_FEATURES
            flags -= AMX_FEATURES

    if torch_capability:
        sources.append("torch")
        need = _TORCH_CAP_NEEDS.get(torch_capability.upper())
        if need and not need <= feats:
            notes.append(f"torch reports capability {torch_capability} but /proc/cpuinfo lacks {sorted(need - feats)}")
        if arch == "x86_64" and torch_capability.upper() in ("AVX2", "DEFAULT") and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= feats:
            notes.append(f"CPU has AVX-512 but torch dispatches {torch_capability} kernels "
                         "(ATEN_CPU_CAPABILITY set, or torch prefers AVX2 on this CPU)")
        if arch == "aarch64" and "sve" in feats and torch_capability.upper() == "DEFAULT":
            notes.append("CPU has SVE but torch reports capability DEFAULT (torch needs 256-bit SVE for its SVE kernels)")

    arm_core, part, sve_bits = None, None, 0
    vendor, model_name = p["vendor"], p["model_name"]
    if arch == "aarch64":
        part = p.get("cpu_part")
        core = ARM_CORES.get(part) if p.get("implementer") == 0x41 else None
        arm_core = core[0] if core else None
        model_name = model_name or (arm_core or f"Arm part 0x{part or 0:x}")
        if "sve" in feats:
            if sve_vector_bits is not None:
                sve_bits = sve_vector_bits
                if core and core[1] and core[1] != sve_bits:
                    notes.append(f"{arm_core} usually has {core[1]}-bit SVE; this process sees {sve_bits}")
            else:
                sve_bits = core[1] if core and core[1] else 128
    else:
        if pycpuinfo and not model_name:
            model_name = pycpuinfo.get("brand_raw", "")

    cache_sizes = dict(caches or {})
    if not cache_sizes and pycpuinfo:
        for key, name in (("l1_data_cache_size", "L1d"), ("l2_cache_size", "L2"), ("l3_cache_size", "L3")):
            if pycpuinfo.get(key):
                try:
                    cache_sizes[name] = int(pycpuinfo[key])
                except (TypeError, ValueError):
                    pass  # e.g. a '1 MiB' string from an older py-cpuinfo
    if not cache_sizes and p.get("cache_size"):
        # The kernel's x86 'cache size' is the last-level cache on Intel (L3 on every Xeon) but the
        # per-core L2 on AMD and Hygon.
        m = re.match(r"(\d+)\s*KB", p["cache_size"])
        if m:
            llc = "L3" if vendor == "GenuineIntel" else "L2"
            cache_sizes[llc] = int(m.group(1)) * 1024

    capped = apply_isa_cap(arch, feats, cap)
    if "sve" not in capped:
        sve_bits_capped = 0
    else:
        sve_bits_capped = sve_bits
    return CPUInfo(
        arch=arch, vendor=vendor, model_name=model_name,
        physical_cores=max(1, p["physical"]), logical_cpus=max(1, p["logical"]),
        cache_sizes=cache_sizes, isa=frozenset(capped), isa_uncapped=frozenset(feats), isa_cap=normalize_isa_cap(cap),
        flags=frozenset(flags),
        sve_vector_bits=sve_bits_capped, arm_core=arm_core, arm_cpu_part=part,
        torch_capability=torch_capability, family=p.get("family"), model=p.get("model"),
        disagreements=tuple(notes), sources=tuple(sources),
    )


@functools.lru_cache(maxsize=None)
def _detect_cached(cap: str | None) -> CPUInfo:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    if not text.strip():
        # Not Linux: fall back on py-cpuinfo alone.
        info = _pycpuinfo() or {}
        arch = "aarch64" if platform.machine() in ("aarch64", "arm64") else "x86_64"
        key = "flags" if arch == "x86_64" else "features"
        text = f"processor\t: 0\nvendor_id\t: {info.get('vendor_id_raw', '')}\n" \
               f"model name\t: {info.get('brand_raw', '')}\n{key}\t: {' '.join(info.get('flags', []))}\n"
    arch_live = platform.machine()
    return build_info(
        text,
        pycpuinfo=_pycpuinfo(),
        torch_capability=_torch_capability(),
        amx_os_enabled=_amx_os_enabled(),
        sve_vector_bits=_sve_vector_bits_live() if arch_live == "aarch64" else None,
        caches=_sysfs_caches(),
        cap=cap,
    )


def detect() -> CPUInfo:
    """Detect this machine's CPU (cached per value of ``CPU_OPT_MAX_ISA``)."""
    return _detect_cached(isa_cap_from_env())
