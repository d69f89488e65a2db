#!/usr/bin/env bash
# session 32, GPU call 3 (the same warm machine, 75 s): the controller rows again, then the
# 4- and 16-page queues with the 256 B prefetch hint and without, once more.
export R=$OUT/results; mkdir -p $R
python3 -m kvcore.cli bench --through controller --backend cuda --layout page_first,layer_first --quiet --markdown $R/bench_controller_2.md --json $R/bench_controller_2.json > $R/bench_controller_2.log 2>&1; echo "ctl rc=$?"
for tune in HOST_PREFETCH=256 ""; do tag=$(echo "${tune:-default}" | tr ',=' '_-'); KVIO_CUDA_TUNE=$tune timeout 40 python3 -m kvcore.cli bench --through controller --backend cuda --layout page_first,layer_first --queue-pages 4,16 --quiet --markdown $R/prefetch_${tag}_c3.md > $R/prefetch_${tag}_c3.log 2>&1; echo "$tag rc=$?"; done
