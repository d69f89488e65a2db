#!/usr/bin/env bash
# session 32, GPU call 1: main at 2b5cffa (page-start staged jobs, HOST_PREFETCH knob).
# Build; the controller rows first; the same rows' 4- and 16-page queues once per
# HOST_PREFETCH build, alternating with the default; where a write() of many pages goes;
# then the GPU tests with the time left.
set -u
TOTAL=${TOTAL:-560}
FINAL=$OUT
export OUT=/tmp/g
R=$OUT/results
mkdir -p $R
t0=$SECONDS
left() { echo $((TOTAL - SECONDS + t0)); }
pack() { tar -C $OUT -czf $FINAL/results.tar.gz results; }
{ nproc; grep -m2 "model name\|MHz" /proc/cpuinfo; cat /sys/fs/cgroup/cpu.max 2>/dev/null; } > $R/cpus.txt
DEADLINE_S=100 scripts/gpu_run.sh setup
mv $R/summary.log $R/summary1.log; pack
DEADLINE_S=80 CONTROLLER_LAYOUTS=page_first,layer_first scripts/gpu_run.sh controller
mv $R/summary.log $R/summary2.log; pack
for tune in HOST_PREFETCH=256 "" HOST_PREFETCH=128 HOST_PREFETCH=256; do
  [ $(left) -gt 300 ] || break
  tag=$(echo "${tune:-default}" | tr ',=' '_-'); tt=$SECONDS
  KVIO_CUDA_TUNE=$tune timeout 80 python3 -m kvcore.cli bench --through controller --backend cuda --layout page_first,layer_first --queue-pages 4,16 --quiet --markdown $R/prefetch_${tag}_$((SECONDS-t0)).md > $R/prefetch_${tag}.log 2>&1
  echo "prefetch $tag rc=$? in $((SECONDS-tt)) s at $((SECONDS-t0)) s" >> $R/summary3.log; pack
done
DEADLINE_S=$(( $(left) - 10 )) TESTS_S=$(( $(left) - 15 < 270 ? $(left) - 15 : 270 )) scripts/gpu_run.sh tests
mv $R/summary.log $R/summary4.log; pack
[ $(left) -gt 30 ] && { timeout $(( $(left) - 5 )) python3 scripts/probe_write_parts.py --pages 1,16,64 --queues 3 > $R/write_parts.log 2>&1; echo "parts rc=$? at $((SECONDS-t0)) s" >> $R/summary3.log; pack; }
cat $R/summary*.log
