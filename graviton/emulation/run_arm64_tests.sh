#!/usr/bin/env bash
# `make test-arm64`: run cpu_opt's aarch64 tests (tests/graviton/arm64) under qemu-user emulation,
# once as a Neoverse V1 (Graviton3: SVE 256, BF16, I8MM) and once as a Neoverse N1 (Graviton2:
# no BF16), on an x86-64 Debian host, as root. From scratch it:
#
#   1. builds an arm64 Debian bookworm root with mmdebstrap --variant=extract (packages are only
#      unpacked, so nothing runs under emulation while building; no util-linux, so no lscpu,
#      which py-cpuinfo would read and mix the host's flags in);
#   2. unpacks (does not install) qemu-user 10 from bookworm-backports (QEMU 7.2 in bookworm has
#      no neoverse-v1 model) into the cache;
#   3. downloads the aarch64 wheels listed in requirements-arm64.txt on the host
#      (pip download --platform manylinux_2_28_aarch64 --no-deps) and installs them into the
#      root with pip install --target;
#   4. registers a binfmt_misc handler for aarch64 ELF binaries for the run only;
#   5. per CPU model, in a private mount namespace: mounts /proc, /sys (without it torch
#      misdetects the CPU), /dev and a tmpfs /tmp into the root, bind-mounts a fresh copy of
#      cpu_opt's packages and tests, and runs pytest with QEMU_CPU set;
#   6. removes the binfmt handler and every mount on exit (trap), failure included.
#
# Steps 1-3 are cached under $CPU_OPT_ARM64_CACHE (default /var/cache/cpu_opt-arm64, kept
# across fresh clones on the same machine), keyed by the package lists. Exits non-zero when any
# aarch64 test fails, errors, or is skipped (a skip there would hide a missing feature).
#
# Environment: CPU_OPT_ARM64_CACHE (cache dir), CPU_OPT_ARM64_JOBS (1 or 2 runs in parallel,
# default 2), CPU_OPT_ARM64_TIMEOUT (seconds per run, default 1500), CPU_OPT_ARM64_MIRROR,
# CPU_OPT_ARM64_PYTEST_ARGS (extra pytest arguments, e.g. "-k cache").
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/graviton/emulation"
CACHE="${CPU_OPT_ARM64_CACHE:-/var/cache/cpu_opt-arm64}"
JOBS="${CPU_OPT_ARM64_JOBS:-2}"
RUN_TIMEOUT="${CPU_OPT_ARM64_TIMEOUT:-1500}"
MIRROR="${CPU_OPT_ARM64_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
ROOT_PACKAGES="python3,libstdc++6,libgomp1"
PYVER=3.11                       # bookworm's python3
REQS="$HERE/requirements-arm64.txt"
BINFMT_DIR=/proc/sys/fs/binfmt_misc
BINFMT_NAME="cpu_opt-aarch64-$$"

T0=$(date +%s)
log() { printf '[arm64 %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { printf '[arm64] ERROR: %s\n' "$*" >&2; exit 2; }

# ----------------------------------------------------------------------------- preconditions
[ "$(id -u)" = 0 ] || die "must run as root (mounts, chroot, binfmt_misc)"
[ "$(uname -s)" = Linux ] || die "needs Linux"
[ "$(uname -m)" = x86_64 ] || die "written for x86-64 hosts (it emulates aarch64 with qemu-user); host is $(uname -m)"
for t in unshare chroot dpkg-deb apt-get python3 sha256sum timeout; do
  command -v "$t" >/dev/null || die "missing host tool: $t"
done
python3 -m pip --version >/dev/null 2>&1 || die "host python3 has no pip"
if ! command -v mmdebstrap >/dev/null; then
  log "installing mmdebstrap (Debian package) on the host"
  apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null; } \
    || die "could not install mmdebstrap"
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock -w 1800 9 || die "another run holds $CACHE/.lock"

# Paths under $1 that are mount points in this namespace (deepest first).
mounts_under() {
  awk -v r="$1/" '{ p=$5; gsub(/\\040/, " ", p); if (index(p, r) == 1) print p }' /proc/self/mountinfo | sort -r
}
safe_rm() {  # never remove a tree that still has something mounted inside it
  local d="$1"
  [ -e "$d" ] || return 0
  if [ -n "$(mounts_under "$d")" ]; then die "refusing to remove $d: still has mounts: $(mounts_under "$d" | tr '\n' ' ')"; fi
  rm -rf --one-file-system "$d"
}

WORK=""
MOUNTED_BINFMT=0
REGISTERED=0
cleanup() {
  local rc=$?
  set +e
  if [ "$REGISTERED" = 1 ] && [ -e "$BINFMT_DIR/$BINFMT_NAME" ]; then
    echo -1 > "$BINFMT_DIR/$BINFMT_NAME" && log "binfmt handler $BINFMT_NAME removed"
  fi
  if [ "$MOUNTED_BINFMT" = 1 ]; then
    umount "$BINFMT_DIR" && log "binfmt_misc unmounted"
  fi
  # The runs mount inside private namespaces that vanish with them; this catches anything left
  # in ours (for instance if unshare was interrupted half-way).
  if [ -n "${ROOT:-}" ]; then
    for m in $(mounts_under "$ROOT"); do umount -l "$m" && log "unmounted leftover $m"; done
  fi
  if [ -n "$WORK" ]; then
    for m in $(mounts_under "$WORK"); do umount -l "$m"; done
    rm -rf --one-file-system "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# ----------------------------------------------------------------------------- 1. qemu-user 10
QEMU_DIR="$CACHE/qemu"
QEMU="$QEMU_DIR/usr/bin/qemu-aarch64"
qemu_ok() {  # (no grep -q in a pipe: under pipefail its early exit would fail the pipe)
  [ -x "$QEMU" ] || return 1
  local models; models="$("$QEMU" -cpu help 2>/dev/null || true)"   # it exits 1 after listing
  grep -qw neoverse-v1 <<< "$models" && grep -qw neoverse-n1 <<< "$models"
}
if ! qemu_ok; then
  log "fetching qemu-user from $SUITE-backports (unpacked into the cache, not installed)"
  A="$CACHE/apt-backports"
  safe_rm "$A"; mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/dl"
  echo "deb $MIRROR $SUITE-backports main" > "$A/sources.list"
  APT=(-o Dir::Etc::SourceList="$A/sources.list" -o Dir::Etc::SourceParts=/dev/null
       -o Dir::State::Lists="$A/lists" -o Dir::Cache="$A/cache" -o APT::Sandbox::User=root)
  apt-get "${APT[@]}" -qq update
  (cd "$A/dl" && apt-get "${APT[@]}" -qq download qemu-user)
  safe_rm "$QEMU_DIR"; mkdir -p "$QEMU_DIR"
  dpkg-deb -x "$A"/dl/qemu-user_*.deb "$QEMU_DIR.tmp"
  mkdir -p "$QEMU_DIR/usr/bin"
  mv "$QEMU_DIR.tmp/usr/bin/qemu-aarch64" "$QEMU"
  rm -rf "$QEMU_DIR.tmp" "$A/dl"
  qemu_ok || die "qemu-aarch64 from $SUITE-backports lacks the neoverse-v1/neoverse-n1 CPU models"
fi
log "qemu: $("$QEMU" --version | head -1)"

# ----------------------------------------------------------------------------- 2. wheels
KEY=$( { cat "$REQS"; echo "$SUITE $ROOT_PACKAGES $PYVER root-layout-1"; } | sha256sum | cut -c1-16)
WHEELS="$CACHE/wheels-$(sha256sum "$REQS" | cut -c1-16)"
if [ ! -f "$WHEELS/.complete" ]; then
  log "downloading aarch64 wheels ($(grep -cv '^\s*\(#\|$\)' "$REQS") packages)"
  safe_rm "$WHEELS"; mkdir -p "$WHEELS"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --python-version "$PYVER" --implementation cp \
    -d "$WHEELS" -r "$REQS"
  touch "$WHEELS/.complete"
fi

# ----------------------------------------------------------------------------- 3. root file system
ROOT="$CACHE/root-$KEY"
SITE="$ROOT/usr/local/lib/python$PYVER/dist-packages"
if [ ! -f "$ROOT/.cpu_opt-ready" ]; then
  log "building the arm64 root ($SUITE, extract variant: $ROOT_PACKAGES)"
  for old in "$CACHE"/root-*; do [ -e "$old" ] && safe_rm "$old"; done
  TMPROOT="$ROOT.tmp"
  mmdebstrap --quiet --mode=root --variant=extract --arch=arm64 --include="$ROOT_PACKAGES" \
    "$SUITE" "$TMPROOT" "deb $MIRROR $SUITE main"
  mkdir -p "$TMPROOT/proc" "$TMPROOT/sys" "$TMPROOT/dev" "$TMPROOT/tmp" "$TMPROOT/opt/cpu_opt"
  rm -f "$TMPROOT/usr/bin/lscpu"
  log "installing the wheels into the root (pip install --target)"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --python-version "$PYVER" --implementation cp \
    --target "$TMPROOT/usr/local/lib/python$PYVER/dist-packages" "$WHEELS"/*.whl
  if python3 -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$PYVER'.split('.'))))"; then
    # Byte-compile on the host (same bytecode for every 3.11.x): spares the emulated first import.
    log "byte-compiling the root's site-packages on the host"
    python3 -m compileall -q -j 2 -s "$TMPROOT" -p / "$TMPROOT/usr/local/lib/python$PYVER/dist-packages" >/dev/null || true
  fi
  touch "$TMPROOT/.cpu_opt-ready"
  mv "$TMPROOT" "$ROOT"
fi
[ ! -e "$ROOT/usr/bin/lscpu" ] || die "lscpu is in the root; py-cpuinfo would mix in the host's flags"
log "root ready: $ROOT ($(du -sh "$ROOT" | cut -f1))"

# ----------------------------------------------------------------------------- 4. stage cpu_opt
WORK="$(mktemp -d "$CACHE/work.XXXXXX")"
STAGE="$WORK/src"
python3 - "$REPO" "$STAGE" <<'PY'
import pathlib, shutil, sys
repo, dst = map(pathlib.Path, sys.argv[1:])
try:
    import tomllib
    cfg = tomllib.loads((repo / "pyproject.toml").read_text())
    package_dir = cfg["tool"]["setuptools"]["package-dir"]
except Exception:  # host python < 3.11: the layout DESIGN.md fixes
    package_dir = {"cpu_opt": "cpu_opt", "cpu_opt.quant": "quant", "cpu_opt.gnn": "gnn", "cpu_opt.graviton": "graviton"}
# aarch64 has no C compiler in the root and no oneDNN wheel: leave out the x86 build products.
skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "_cdef_generated.py", "emulation")
for name, src in sorted(package_dir.items(), key=lambda kv: kv[0].count(".")):
    shutil.copytree(repo / src, dst.joinpath(*name.split(".")), ignore=skip, dirs_exist_ok=True)
shutil.copytree(repo / "tests" / "graviton", dst / "tests" / "graviton", ignore=skip)
PY

# ----------------------------------------------------------------------------- 5. binfmt_misc
if ! mountpoint -q "$BINFMT_DIR"; then
  mount -t binfmt_misc binfmt_misc "$BINFMT_DIR" || die "cannot mount binfmt_misc at $BINFMT_DIR"
  MOUNTED_BINFMT=1
fi
# aarch64 ELF executables; flag F opens qemu now, so it need not exist inside the root.
printf '%s' ":$BINFMT_NAME:M::\\x7fELF\\x02\\x01\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x02\\x00\\xb7\\x00:\\xff\\xff\\xff\\xff\\xff\\xff\\xff\\x00\\xff\\xff\\xff\\xff\\xff\\xff\\xff\\xff\\xfe\\xff\\xff\\xff:$QEMU:F" \
  > "$BINFMT_DIR/register" || die "cannot register a binfmt_misc handler"
REGISTERED=1
log "binfmt handler $BINFMT_NAME registered ($QEMU)"

# ----------------------------------------------------------------------------- 6. the runs
# name | QEMU_CPU | expected core | pytest -m expression | extra environment
RUNS=(
  "neoverse-v1|neoverse-v1|Neoverse V1|not n1|"
  "neoverse-n1|neoverse-n1|Neoverse N1|not v1|CPU_OPT_FAST_MATH=1"
)
NCPU=$(nproc)
THREADS=$(( NCPU / (JOBS > 1 ? JOBS : 1) )); [ "$THREADS" -ge 1 ] || THREADS=1

run_one() {  # name qemu_cpu core marker extra_env -> writes $WORK/<name>.log, returns pytest's code
  local name="$1" cpu="$2" core="$3" marker="$4" extra="$5"
  # shellcheck disable=SC2086
  timeout --kill-after=30 "$RUN_TIMEOUT" unshare --mount --propagation private -- /bin/bash -euc '
    R="$1"; S="$2"; shift 2
    mount -t proc proc "$R/proc"
    mount --rbind /sys "$R/sys"
    mount --rbind /dev "$R/dev"
    mount -t tmpfs -o size=4g,mode=1777 tmpfs "$R/tmp"
    mount --bind "$S" "$R/opt/cpu_opt"
    mount -o remount,bind,ro "$R/opt/cpu_opt"
    exec "$@"
  ' _ "$ROOT" "$STAGE" \
    env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 \
      PYTHONPATH=/opt/cpu_opt \
      QEMU_CPU="$cpu" OMP_NUM_THREADS="$THREADS" \
      CPU_OPT_ARM64_REQUIRED=1 CPU_OPT_EXPECT_CORE="$core" $extra \
    "$(command -v chroot)" "$ROOT" /usr/bin/python3 -m pytest -p no:cacheprovider -q -rfEs -W ignore::DeprecationWarning \
      --rootdir=/opt/cpu_opt -m "$marker" ${CPU_OPT_ARM64_PYTEST_ARGS:-} /opt/cpu_opt/tests/graviton/arm64 \
    > "$WORK/$name.log" 2>&1
}

declare -A RC START END
pids=()
for spec in "${RUNS[@]}"; do
  IFS='|' read -r name cpu core marker extra <<< "$spec"
  log "run $name: QEMU_CPU=$cpu ${extra:+$extra }pytest -m '$marker' (OMP_NUM_THREADS=$THREADS)"
  START[$name]=$(date +%s)
  if [ "$JOBS" -gt 1 ]; then
    ( set +e; run_one "$name" "$cpu" "$core" "$marker" "$extra"; echo $? > "$WORK/$name.rc"; date +%s > "$WORK/$name.end" ) &
    pids+=($!)
  else
    set +e; run_one "$name" "$cpu" "$core" "$marker" "$extra"; echo $? > "$WORK/$name.rc"; date +%s > "$WORK/$name.end"; set -e
  fi
done
for p in "${pids[@]}"; do wait "$p" || true; done

# ----------------------------------------------------------------------------- 7. report
passed=0; failed=0; skipped=0; errors=0; bad=0
for spec in "${RUNS[@]}"; do
  IFS='|' read -r name _ _ _ _ <<< "$spec"
  rc=$(cat "$WORK/$name.rc" 2>/dev/null || echo 99)
  secs=$(( $(cat "$WORK/$name.end" 2>/dev/null || date +%s) - START[$name] ))
  echo "==================== aarch64 run: $name (exit $rc, ${secs}s) ===================="
  cat "$WORK/$name.log"
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|errors|skipped|deselected)' "$WORK/$name.log" | tail -1 || true)
  [ -n "$summary" ] || summary="(no pytest summary line: the run did not finish; exit $rc)"
  echo "$name: $summary"
  p=$(grep -oE '[0-9]+ passed' <<< "$summary" | grep -oE '[0-9]+' || echo 0)
  f=$(grep -oE '[0-9]+ failed' <<< "$summary" | grep -oE '[0-9]+' || echo 0)
  s=$(grep -oE '[0-9]+ skipped' <<< "$summary" | grep -oE '[0-9]+' || echo 0)
  e=$(grep -oE '[0-9]+ errors?' <<< "$summary" | grep -oE '[0-9]+' || echo 0)
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s)); errors=$((errors + e))
  if [ "$rc" != 0 ] || [ "$p" = 0 ] || [ "$s" != 0 ]; then bad=1; fi
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "$name: timed out after ${RUN_TIMEOUT}s"
done
log "total wall time $(( $(date +%s) - T0 ))s"
[ "$skipped" = 0 ] || echo "arm64: $skipped test(s) were skipped under emulation; that counts as a failure here"
echo "arm64: $passed passed, $((failed + errors)) failed, $skipped skipped"
[ "$bad" = 0 ] && [ "$failed" = 0 ] && [ "$errors" = 0 ]
