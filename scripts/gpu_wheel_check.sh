#!/usr/bin/env bash
# On a CUDA GPU machine, no network needed: the built wheels run without nvcc (issue 22).
#
#   scripts/build_wheels.sh                  # on any machine with nvcc; dist/ must travel along
#   OUT=/some/dir scripts/gpu_wheel_check.sh # on the GPU machine, as root (it moves folders)
#
# 1. nvcc made unreachable: directories holding nvcc dropped from PATH, CUDA_HOME/CUDA_PATH
#    unset, /usr/local/cuda* moved aside (put back at exit, also on failure or Ctrl-C; if torch
#    cannot start without the toolkit's folder, only its bin/ is moved aside), an nvcc of the
#    nvidia-cuda-nvcc package renamed; kvio_cuda's own nvcc search must then fail.
# 2. a fresh install of dist/*.whl into this machine's python (pip --no-deps --no-index
#    --force-reinstall; its CUDA torch is kept), the build cache pointed at an empty folder;
# 3. `kvio backends` must name the prebuilt sm_90a library (SM, default sm_90a for an H200),
#    then `pytest -q tests/gpu` and `kvio check cuda` (full size) must pass, and the build
#    cache must still be empty: nothing was compiled;
# 4. nvcc put back and KVIO_CUDA_TUNE set (default UNROLL=4, the shipped value): the library is
#    built on first use (`kvio build`), the cache holds it, and `pytest -q tests/gpu` passes on it.
#
# CHECK=0 leaves out `kvio check cuda`, TUNED=0 leaves out step 4: one device call each when
# the whole run does not fit in one (kvio check alone took 280-330 s on an H200).
#
# Logs, one file per step and summary.log, go to $OUT (default ./gpu-wheel-results).
# Budgets in seconds: DEADLINE_S for the whole run (default 460, under 8 minutes), CHECK_S for
# `kvio check cuda` (default 320; it took about 5 minutes on an H200).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-wheel-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=$(command -v "${PYTHON:-python3}")
SM=${SM:-sm_90a}
TUNE=${TUNE:-UNROLL=4}
DEADLINE_S=${DEADLINE_S:-460}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PIP_BREAK_SYSTEM_PACKAGES=1
status=0
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo

log() { echo "$*" | tee -a "$OUT/summary.log"; }
fail() { log "FAILED: $*"; status=1; }
step() {  # step NAME SECONDS CMD...: run with a time limit (cut to the deadline), log to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS left=$((DEADLINE_S - SECONDS))
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -le 5 ]; then fail "$name: skipped, out of time"; return 1; fi
    log "=== $name: $*"
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    log "=== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 6 "$OUT/$name.log"
    [ $rc = 0 ] || { fail "$name (rc=$rc)"; return 1; }
}

# ------------------------------------------------------------------- hide and restore nvcc
HIDDEN=()  # "original|hidden" pairs, put back in reverse order
hide() { $SUDO mv "$1" "$1.kvio-hidden" && HIDDEN+=("$1|$1.kvio-hidden") && log "hidden: $1"; }
restore() {
    local i pair
    for ((i = ${#HIDDEN[@]} - 1; i >= 0; i--)); do
        pair=${HIDDEN[$i]}
        $SUDO mv "${pair#*|}" "${pair%%|*}" && log "restored: ${pair%%|*}"
    done
    HIDDEN=()
}
trap restore EXIT
trap 'exit 130' INT TERM

ORIG_PATH=$PATH
ORIG_CUDA_HOME=${CUDA_HOME-}
ORIG_CUDA_PATH=${CUDA_PATH-}
no_nvcc_path() {  # PATH without the directories that hold an nvcc
    local out="" d
    IFS=: read -r -a dirs <<< "$ORIG_PATH"
    for d in "${dirs[@]}"; do [ -e "$d/nvcc" ] || out=${out:+$out:}$d; done
    echo "$out"
}

rm -f "$OUT/summary.log"
log "gpu_wheel_check on $(hostname) at $(date -u +%FT%TZ), python $PY, commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
{ nvidia-smi; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/machine.txt" 2>&1
WHEELS=(dist/kvcore-*.whl dist/kvio_reference-*.whl dist/kvio_cuda-*.whl dist/kvio_rocm-*.whl)
for w in "${WHEELS[@]}"; do [ -f "$w" ] || { fail "no $w: run scripts/build_wheels.sh and carry dist/"; exit 1; }; done
ls -l "${WHEELS[@]}" | tee -a "$OUT/summary.log"

# ------------------------------------------------------------------- 1. no nvcc anywhere
unset CUDA_HOME CUDA_PATH
PATH=$(no_nvcc_path)
export PATH
for d in /usr/local/cuda /usr/local/cuda-*; do
    { [ -e "$d" ] || [ -L "$d" ]; } && [[ $d != *.kvio-hidden ]] && hide "$d"
done
if ! "$PY" -c "import torch; assert torch.cuda.is_available()" > "$OUT/torch_without_toolkit.log" 2>&1; then
    log "torch does not start without the toolkit's folder (see torch_without_toolkit.log): hiding only its bin/"
    restore
    for d in /usr/local/cuda /usr/local/cuda-*; do
        [ -d "$d/bin" ] && [ ! -L "$d" ] && hide "$d/bin"
    done
fi

# ------------------------------------------------------------------- 2. a fresh install
WORK=$(mktemp -d)
export KVCORE_CACHE_DIR=$WORK/kvcore-cache
mkdir -m 700 "$KVCORE_CACHE_DIR"
unset KVIO_CUDA_TUNE KVIO_CUDA_PREBUILT
step install 120 "$PY" -m pip install --no-deps --no-index --force-reinstall "${WHEELS[@]}"
cd "$WORK"  # not the repository: every import comes from the installed wheels
# the registry's nvcc, if this python has one, goes too; then nothing may find an nvcc
nvcc_in_env=$("$PY" -c "from kvio_cuda import build; print(build.registry_nvcc() or '')" 2>/dev/null)
[ -n "$nvcc_in_env" ] && hide "$nvcc_in_env"
"$PY" - > "$OUT/where.log" 2>&1 <<'PY'
import kvcore, kvio_cuda
from kvcore.errors import BuildError
from kvio_cuda import build
print("kvcore", kvcore.__file__)
print("kvio_cuda", kvio_cuda.__file__)
try:
    print("UNEXPECTED nvcc:", build.find_nvcc())
    raise SystemExit(1)
except BuildError as exc:
    print("no nvcc:", exc)
PY
rc=$?
cat "$OUT/where.log" | tee -a "$OUT/summary.log"
[ $rc = 0 ] || fail "an nvcc is still reachable"
grep -q "^kvio_cuda $REPO" "$OUT/where.log" && fail "kvio_cuda was imported from the repository, not the wheel"

# ------------------------------------------------------------------- 3. prebuilt only
KVIO=("$PY" -m kvcore.cli)
step backends_prebuilt 60 "${KVIO[@]}" backends
grep -q "prebuilt library for CUDA [0-9]* ($SM SASS" "$OUT/backends_prebuilt.log" \
    || fail "kvio backends does not name the prebuilt $SM library"
grep -A1 "^cuda " "$OUT/backends_prebuilt.log" | tee -a "$OUT/summary.log"
gpu_tests() {  # gpu_tests NAME: tests/gpu, every test run (a skip means the backend was missing)
    step "$1" 120 "$PY" -m pytest -q -rs -p no:cacheprovider "$REPO/tests/gpu" || return
    grep -Eq "^[0-9]+ passed" "$OUT/$1.log" && ! grep -q " skipped" "$OUT/$1.log" \
        || fail "$1: not every GPU test ran"
}
gpu_tests gpu_tests_prebuilt
if [ "${CHECK:-1}" != 0 ]; then
    step check_cuda_prebuilt "${CHECK_S:-320}" "${KVIO[@]}" check cuda \
        && grep -q "not run" "$OUT/check_cuda_prebuilt.log" && fail "kvio check cuda did not run"
fi
left=$(find "$KVCORE_CACHE_DIR" -mindepth 1 | wc -l)
if [ "$left" = 0 ]; then
    log "build cache $KVCORE_CACHE_DIR is empty: nothing was compiled"
else
    fail "the build cache is not empty:"; find "$KVCORE_CACHE_DIR" -mindepth 1 | tee -a "$OUT/summary.log"
fi

# ------------------------------------------------------------------- 4. nvcc back, tuned build
restore
if [ "${TUNED:-1}" = 0 ]; then
    cd "$REPO"
    rm -rf "$WORK"
    log "=== done in $SECONDS s (TUNED=0: no tuned build), status $status"
    exit $status
fi
PATH=$ORIG_PATH
[ -n "$ORIG_CUDA_HOME" ] && export CUDA_HOME=$ORIG_CUDA_HOME
[ -n "$ORIG_CUDA_PATH" ] && export CUDA_PATH=$ORIG_CUDA_PATH
export KVIO_CUDA_TUNE=$TUNE
log "nvcc back ($(command -v nvcc || echo 'not on PATH')), KVIO_CUDA_TUNE=$KVIO_CUDA_TUNE"
step backends_tuned 60 "${KVIO[@]}" backends
grep -q "to be built on first use into $KVCORE_CACHE_DIR" "$OUT/backends_tuned.log" \
    || fail "with KVIO_CUDA_TUNE set kvio backends does not announce a build on first use"
step build_tuned 180 "${KVIO[@]}" build --backend cuda
grep -q "kvio_cuda: building kernels for $SM" "$OUT/build_tuned.log" || fail "no build on first use"
find "$KVCORE_CACHE_DIR" -name 'libkvio_cuda-*.so' | tee -a "$OUT/summary.log" | grep -q . \
    || fail "the build cache holds no library"
gpu_tests gpu_tests_tuned

cd "$REPO"
rm -rf "$WORK"
log "=== done in $SECONDS s, status $status"
exit $status
