#!/usr/bin/env bash
# session 30, GPU call 1: main at HEAD (controller rows, GPU tests, default stream, runtime calls, write variants, write parts)
set -u
FINAL=$OUT
export OUT=/tmp/g
R=$OUT/results
mkdir -p $R
t0=$SECONDS
pack() { tar -C $OUT -czf $FINAL/results.tar.gz results; }
DEADLINE_S=90 CONTROLLER_LAYOUTS=page_first,layer_first scripts/gpu_run.sh setup controller
mv $R/summary.log $R/summary1.log; pack
DEADLINE_S=$((460 - SECONDS)) TESTS_S=190 scripts/gpu_run.sh tests default_stream runtime_calls
mv $R/summary.log $R/summary2.log; pack
timeout 45 python3 scripts/probe_write_variant.py shipped lookup narrow fenced shipped lookup > $R/probe_write_variant.log 2>&1; echo "variant rc=$? at $((SECONDS-t0)) s" >> $R/summary3.log; pack
timeout 40 python3 scripts/probe_write_parts.py > $R/write_parts.log 2>&1; echo "parts rc=$? at $((SECONDS-t0)) s" >> $R/summary3.log; pack
cat $R/summary1.log $R/summary2.log $R/summary3.log
