#!/usr/bin/env bash
# session 29, GPU call 1: main at HEAD on the H200 (tests, controller rows, write variants,
# write parts, py-spy of one-page writes, default stream)
set -u
FINAL=$OUT
export OUT=/tmp/g
R=$OUT/results
mkdir -p $R
t0=$SECONDS
DEADLINE_S=330 CONTROLLER_LAYOUTS=page_first,layer_first scripts/gpu_run.sh setup controller write_variant tests
echo "part 1 done at $((SECONDS-t0)) s" >> $R/summary.log
timeout 90 python3 scripts/probe_write_parts.py > $R/write_parts.log 2>&1; echo "write_parts rc=$? at $((SECONDS-t0)) s" >> $R/summary.log
mv $R/summary.log $R/summary1.log
DEADLINE_S=150 PROFILE_CASES="write:1 write:4 load:1" PROFILE_RATE=500 scripts/gpu_run.sh profile default_stream
echo "all done at $((SECONDS-t0)) s" >> $R/summary.log
tar -C $OUT -czf $FINAL/results.tar.gz results
cat $R/summary1.log $R/summary.log
