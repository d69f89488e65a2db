#!/usr/bin/env bash
# On any machine with a CUDA GPU: install the project into this machine's python (its own
# CUDA torch is kept), build the kernels, run the GPU tests and the benchmarks, and write
# every result into one folder ($OUT, default ./gpu-results), packed as results.tar.gz.
#
#   scripts/gpu_run.sh [STAGE ...]     stages: setup tests controller replay multi bench seed
#                                      check check_triton probe (default: all but probe, in
#                                      order)
#
# DEADLINE_S bounds the whole run (each step's limit shrinks to fit), so the results are
# always packed. The seed table may take longer than one run: SEED_ARGS narrows it and
# SEED_TAG names its files (bench_seed_TAG.jsonl.gz), and `kvio bench --merge` joins the runs;
# scripts/seed_bars.py checks each run's rows against their bars (seed_bars_TAG.log).
# The seed bench stops starting cases SEED_MARGIN_S (default 60) before the deadline; the
# pure-torch reference is slow: SEED_REFERENCE_REPEAT=1 times its rows by their oracle call
# alone (then the whole table with the reference took 457 s on an H200).
# write_variant: scripts/probe_write_variant.py (controller writes: staged, direct, handed).
# thread_failure: tests/gpu/test_library_thread_failure.py, then its scenario on the library
# with tests/gpu/job_status_fix.patch reverted, which must fail (needs cc and patch).
# publish: scripts/probe_signaled_publish.py (variants of the signaled load's end of layer).
# write_modes: the controller rows once per KVCORE_ASYNC_WRITE_BACK mode in WRITE_MODES.
# profile: py-spy samples of write()/load() loops (PROFILE_CASES op:pages; .whl/ must carry
# the py-spy wheel). PROFILE_RATE samples/s (default 250: with --native, 2000 fell behind by
# 30 s on an H100 host and was killed before writing anything).
# probe_tma: the standalone TMA-against-loads probe (scripts/probe_tma_h2d.cu).
# probe_2d: copy-engine 2D copies of groups of layers from page_first (scripts/probe_2d_rows.cu).
# probe_2e: a per-layer copy-engine load's copies on one stream against two or three
# (scripts/probe_two_engines.cu). probe_hybrid: a page_first per-layer load by the SMs and the
# copy engine at once (scripts/probe_hybrid_load.cu). host_share: this machine's CPU on
# scripts/probe_null_device.py (needs cc; its stand-ins cost more than the CUDA path under the
# GPU image's torch, so compare it only with itself, h100-2026-12-05b) and each runtime call's
# CPU cost in C (scripts/probe_runtime_calls.cu): what the machine, not the code, costs.
# ceiling_spread: how much the bench's ceiling copy moves between samples, fresh buffers or not.
# runtime_calls: scripts/probe_runtime_calls.cu alone (copies of 64 KiB to 32 MiB too).
# queue_factors: scripts/probe_queue_factors.py (why the bench's queues of controller calls cost
# the caller more than probe_call_parts' on one machine: one factor changed at a time).
# submit_cost: cProfile of controller calls, once per page count in SUBMIT_PAGES.
# probe: scripts/probe_layer_load.py once per kernel build setting in PROBE_TUNES
# (';'-separated KVIO_CUDA_TUNE values, '' = the shipped defaults). probe_h2d: the standalone
# copy-path probe (scripts/probe_h2d_paths.cu). issue: Python's cost per per-layer call.
# dma: layer_first per-layer load, copy engine against the zero-copy kernel, once per build
# setting in DMA_TUNES (as PROBE_TUNES; e.g. ";DMA_BATCH=64;DMA_BATCH=32" splits the batches).
# quick: the seed rows issue 4 missed, cuda only (QUICK_ARGS replaces the axes).
# sglang: scripts/gpu_sglang_check.py (after setup), writes gpu_sglang_check.{log,json}.
# seed and quick warm up BENCH_WARMUP rounds (default 1), each calling every index set once,
# so no timed call is the first on its pages (kvio bench --warmup counts rounds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
R="$OUT/results"
mkdir -p "$R"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
KVIO=("$PY" -m kvcore.cli)
STAGES=("$@"); [ ${#STAGES[@]} -gt 0 ] || STAGES=(setup tests controller replay multi bench seed check check_triton)
status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $R/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS left=$(( ${DEADLINE_S:-100000} - SECONDS ))
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -le 5 ]; then echo "=== $name: skipped, out of time" | tee -a "$R/summary.log"; status=1; return; fi
    echo "=== $name: $*" | tee -a "$R/summary.log"
    timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$R/summary.log"
    tail -n 8 "$R/$name.log"
    [ $rc = 0 ] || status=1
}
cuda_probe() {  # cuda_probe NAME SOURCE SECONDS: build a standalone CUDA probe, run it, drop it
    step "$1_build" 120 nvcc -O3 -std=c++17 -arch=sm_90a -o "$R/$1" "$2"
    step "$1" "$3" "$R/$1"
    rm -f "$R/$1"
}

for stage in "${STAGES[@]}"; do case $stage in
setup)
    KVCORE_PYTHON_ENV=system scripts/install.sh
    $PY -m pip install -q --no-deps --no-build-isolation -e examples/kvio_triton || true
    { nvidia-smi; nvcc --version; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } > "$R/machine.txt" 2>&1
    step backends 60 "${KVIO[@]}" backends
    step build 120 "${KVIO[@]}" build
    ;;
tests)
    step gpu_tests ${TESTS_S:-300} $PY -m pytest -q -rs tests/gpu
    ;;
controller)  # the path an engine calls: queues of controller calls (the README's headline)
    step bench_controller ${CONTROLLER_S:-400} "${KVIO[@]}" bench --through controller --backend cuda --layout ${CONTROLLER_LAYOUTS:-page_first} --markdown "$R/bench_controller.md" --json "$R/bench_controller.json"
    ;;
bench)
    step bench_single_page 60 "${KVIO[@]}" bench --through kernel --preset single-page --backend cuda --backend reference --markdown "$R/bench_single_page.md" --json "$R/bench_single_page.jsonl.gz"
    ;;
seed)
    tag=${SEED_TAG:-all}
    budget=$(( ${DEADLINE_S:-100000} - SECONDS - ${SEED_MARGIN_S:-60} ))
    step "bench_seed_$tag" ${SEED_S:-3600} "${KVIO[@]}" bench --through kernel --preset seed --layout ${SEED_LAYOUTS:-page_first,layer_first} ${SEED_ARGS:-} --backend cuda --backend reference --warmup ${BENCH_WARMUP:-1} --repeat 5 ${SEED_REFERENCE_REPEAT:+--reference-repeat "$SEED_REFERENCE_REPEAT"} --time-limit "$budget" --markdown "$R/bench_seed_$tag.md" --json "$R/bench_seed_$tag.jsonl.gz"
    [ -s "$R/bench_seed_$tag.jsonl.gz" ] && $PY scripts/seed_bars.py "$R/bench_seed_$tag.jsonl.gz" > "$R/seed_bars_$tag.log" 2>&1
    tail -n 12 "$R/seed_bars_$tag.log" 2>/dev/null
    ;;
replay)
    step replay_cuda 120 "${KVIO[@]}" replay --device cuda --min-transfers 1000000 --concurrency 128 --sessions 1024 --log "$R/replay_cuda.jsonl"
    ;;
multi)
    step multi_gpu_n1 90 $PY scripts/multi_gpu_bench.py --nprocs 1 --json "$R/multi_gpu_bench_h200_n1.json" --markdown "$R/multi_gpu_bench_h200_n1.md"
    ;;
check)  # the conformance suite, full size, against the reference
    step check_cuda ${CHECK_S:-400} "${KVIO[@]}" check cuda
    ;;
check_triton)
    step check_triton 300 "${KVIO[@]}" check triton
    ;;
probe)
    IFS=';' read -r -a tunes <<< "${PROBE_TUNES:-;UNROLL=8;UNROLL=8,BLOCKS_PER_SM=2;UNROLL=16,BLOCKS_PER_SM=1}"
    for tune in "${tunes[@]}"; do
        tag=$(echo "${tune:-default}" | tr ',=' '_-')
        KVIO_CUDA_TUNE=$tune step "probe_$tag" 120 $PY scripts/probe_layer_load.py --json "$R/probe_$tag.json"
    done
    ;;
probe_h2d)
    cuda_probe probe_h2d scripts/probe_h2d_paths.cu 240
    ;;
write_modes)  # the controller's rows once per write-back issue mode (KVCORE_ASYNC_WRITE_BACK)
    for mode in ${WRITE_MODES:-0 1}; do
        KVCORE_ASYNC_WRITE_BACK=$mode step "bench_controller_mode_$mode" ${CONTROLLER_S:-400} "${KVIO[@]}" bench --through controller --backend cuda --layout ${CONTROLLER_LAYOUTS:-page_first} --markdown "$R/bench_controller_mode_$mode.md" --json "$R/bench_controller_mode_$mode.json"
    done
    ;;
thread_failure)  # a library-thread write-back failed part way (LD_PRELOAD shim): the test passes on
    # this library; the same scenario with kvio_cuda's job-status fix reverted must fail (rc 1)
    step thread_failure 120 $PY -m pytest -q -rs tests/gpu/test_library_thread_failure.py
    cu=plugins/kvio_cuda/kvio_cuda/csrc/kvio_cuda.cu
    cp "$cu" /tmp/kvio_cuda_kept.cu
    if cc -O2 -shared -fPIC -o /tmp/fault_shim.so tests/gpu/fault_shim.c -ldl -lpthread \
            && patch -s -p1 -R < tests/gpu/job_status_fix.patch; then
        step build_fix_reverted 150 "${KVIO[@]}" build
        keep=$status
        step thread_failure_fix_reverted 60 env LD_PRELOAD=/tmp/fault_shim.so $PY tests/gpu/thread_failure_scenario.py
        if grep -q "copies enqueued before it were still queued" "$R/thread_failure_fix_reverted.log"; then
            status=$keep; echo "=== thread_failure_fix_reverted: failed, as it must" | tee -a "$R/summary.log"
        else
            status=1; echo "=== thread_failure_fix_reverted: did NOT fail the reverted library" | tee -a "$R/summary.log"
        fi
    else
        echo "=== thread_failure: no cc or the patch does not apply" | tee -a "$R/summary.log"; status=1
    fi
    cp /tmp/kvio_cuda_kept.cu "$cu"
    ;;
write_variant)  # controller write-backs, staged against the direct kernel (probe_write_variant.py)
    step probe_write_variant ${WRITE_VARIANT_S:-300} $PY scripts/probe_write_variant.py
    ;;
publish)  # the signaled load's end of layer, one kernel build per variant (probe_signaled_publish.py)
    step probe_signaled_publish ${PUBLISH_S:-400} $PY scripts/probe_signaled_publish.py
    ;;
profile)  # py-spy over loops of controller calls (needs the py-spy wheel carried in .whl/)
    $PY -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy*.whl || { echo "no py-spy wheel in .whl/"; status=1; }
    for c in ${PROFILE_CASES:-write:1 write:16 load:1 load:64}; do
        op=${c%%:*}; pages=${c##*:}; batch=32; [ "$pages" -ge 16 ] && batch=8
        step "profile_${op}_${pages}p" 90 /tmp/pyspy/bin/py-spy record --native --rate ${PROFILE_RATE:-250} --format raw -o "$R/profile_${op}_${pages}p.txt" -- $PY scripts/probe_hot_path.py --op "$op" --pages "$pages" --seconds 5 --batch "$batch"
        if [ -s "$R/profile_${op}_${pages}p.txt" ]; then
            $PY scripts/probe_hot_path.py --summarize "$R/profile_${op}_${pages}p.txt" --root "$op" --top 70 >> "$R/profile_${op}_${pages}p.log" 2>&1
        else
            echo "=== profile_${op}_${pages}p: py-spy wrote no samples" | tee -a "$R/summary.log"
        fi
    done
    ;;
probe_2d)  # copy-engine 2D copies of layer groups from page_first (scripts/probe_2d_rows.cu)
    cuda_probe probe_2d scripts/probe_2d_rows.cu 240
    ;;
probe_tma)  # SM bulk copies (TMA) from pinned memory against vector loads (scripts/probe_tma_h2d.cu)
    cuda_probe probe_tma scripts/probe_tma_h2d.cu 240
    ;;
probe_2e)  # per-layer copy-engine loads over one stream against two or three (scripts/probe_two_engines.cu)
    cuda_probe probe_2e scripts/probe_two_engines.cu 120
    ;;
probe_hybrid)  # a page_first per-layer load by the SMs and the copy engine at once (scripts/probe_hybrid_load.cu)
    cuda_probe probe_hybrid scripts/probe_hybrid_load.cu 120
    ;;
host_share)  # this machine's CPU: the null-device probe and each runtime call in C
    step null_device 180 $PY scripts/probe_null_device.py --calls 2000 --pages 1 64
    cuda_probe runtime_calls scripts/probe_runtime_calls.cu 60
    ;;
ceiling_spread)  # the bench's ceiling copy sampled again and again (scripts/probe_ceiling_spread.py)
    step ceiling_spread 150 $PY scripts/probe_ceiling_spread.py
    ;;
runtime_calls)  # each runtime call's CPU cost in C alone (host_share without the null device)
    cuda_probe runtime_calls scripts/probe_runtime_calls.cu 60
    ;;
issue)
    step issue_cost 90 $PY scripts/probe_issue_cost.py
    ;;
call_parts)  # each piece of the submit path alone, median us
    step call_parts 120 $PY scripts/probe_call_parts.py --json "$R/call_parts.json"
    ;;
queue_factors)  # the bench's queues of controller calls against plain loops, one factor at a time
    step queue_factors 300 $PY scripts/probe_queue_factors.py --json "$R/queue_factors.json"
    ;;
default_stream)  # per-layer loads from layer_first on the legacy default stream
    step default_stream 120 $PY scripts/probe_default_stream.py
    ;;
queue_gap)  # a queue of per-layer loads with parts of the path taken away (scripts/probe_queue_gap.py)
    step queue_gap 120 $PY scripts/probe_queue_gap.py
    ;;
submit_cost)  # where the CPU time of one controller call goes (cProfile)
    for pages in ${SUBMIT_PAGES:-1}; do
        step "submit_cost_${pages}p" 120 $PY scripts/probe_submit_cost.py --pages "$pages" --calls "${SUBMIT_CALLS:-400}"
    done
    ;;
dma)
    IFS=';' read -r -a tunes <<< "${DMA_TUNES:-}"
    [ ${#tunes[@]} -gt 0 ] || tunes=("")
    for tune in "${tunes[@]}"; do
        tag=$(echo "${tune:-default}" | tr ',=' '_-')
        KVIO_CUDA_TUNE=$tune step "probe_dma_$tag" 150 $PY scripts/probe_dma_load.py
    done
    ;;
sglang)  # kvcore-sglang's hook bodies with kvio_cuda on SGLang-shaped pools (no sglang needed)
    step sglang_check 300 $PY scripts/gpu_sglang_check.py --out "$R"
    ;;
quick)
    budget=$(( ${DEADLINE_S:-100000} - SECONDS - ${SEED_MARGIN_S:-60} ))
    step bench_quick ${SEED_S:-3600} "${KVIO[@]}" bench --through kernel --preset seed --backend cuda ${QUICK_ARGS:---op load_layer,write_back --layout page_first,layer_first --num-layers 16,48,72,80} --warmup ${BENCH_WARMUP:-1} --repeat 5 --time-limit "$budget" --markdown "$R/bench_quick.md" --json "$R/bench_quick.jsonl.gz"
    ;;
*) echo "unknown stage $stage"; exit 2;;
esac; done

tar -C "$OUT" -czf "$OUT/results.tar.gz" results
cp "$R/summary.log" "$OUT/summary.log"
exit $status
