#!/usr/bin/env bash
# session 31, GPU call 1: main as is. GPU tests, controller rows, then where a write() of
# many pages spends the caller's time (thread CPU, page faults, host contention, a native
# profile), with the host's /proc/stat around each step; then the seed's layer_first
# per-layer and all-layer loads while time is left. TOTAL: seconds for the whole call.
set -u
TOTAL=${TOTAL:-545}
FINAL=$OUT
export OUT=/tmp/g
R=$OUT/results
mkdir -p $R
t0=$SECONDS
left() { echo $((TOTAL - SECONDS + t0)); }
pack() { tar -C $OUT -czf $FINAL/results.tar.gz results; }
stat() { echo "$1 at $((SECONDS-t0)) s: $(grep '^cpu ' /proc/stat)" >> $R/proc_stat.log; }
{ nproc; grep -m2 "model name\|MHz" /proc/cpuinfo; cat /sys/fs/cgroup/cpu.max 2>/dev/null; } > $R/cpus.txt
stat start
DEADLINE_S=200 TESTS_S=160 scripts/gpu_run.sh setup tests
mv $R/summary.log $R/summary1.log; stat tests; pack
DEADLINE_S=$(( $(left) < 80 ? $(left) : 80 )) CONTROLLER_LAYOUTS=page_first,layer_first scripts/gpu_run.sh controller
mv $R/summary.log $R/summary2.log; stat controller; pack
[ $(left) -gt 60 ] && { timeout 45 python3 scripts/probe_write_parts.py --pages 1,16,64 --queues 3 > $R/write_parts.log 2>&1; echo "parts rc=$? at $((SECONDS-t0)) s" >> $R/summary3.log; stat parts; pack; }
[ $(left) -gt 40 ] && { timeout 30 python3 scripts/probe_host_contention.py > $R/host_contention.log 2>&1; echo "contention rc=$? at $((SECONDS-t0)) s" >> $R/summary3.log; stat contention; pack; }
[ $(left) -gt 70 ] && { PROFILE_CASES="write:64" DEADLINE_S=60 scripts/gpu_run.sh profile; mv $R/summary.log $R/summary4.log; stat profile; pack; }
[ $(left) -gt 120 ] && { SEED_TAG=lf_loads SEED_LAYOUTS=layer_first SEED_ARGS="--op load_layer,load_all --num-layers 16,24,48,80" SEED_REFERENCE_REPEAT=1 SEED_MARGIN_S=10 DEADLINE_S=$(( $(left) - 10 )) scripts/gpu_run.sh seed; mv $R/summary.log $R/summary5.log; stat seed; pack; }
cat $R/summary*.log
