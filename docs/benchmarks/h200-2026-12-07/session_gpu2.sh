#!/usr/bin/env bash
# session 30, GPU call 2: the seed table, cuda beside the reference (load_layer first, then the rest)
set -u
FINAL=$OUT
export OUT=/tmp/g2
R=$OUT/results
mkdir -p $R
pack() { tar -C $OUT -czf $FINAL/results2.tar.gz results; }
( while sleep 30; do pack; done ) &
DEADLINE_S=${D:-560} SEED_MARGIN_S=10 SEED_TAG=load_layer SEED_ARGS="--op load_layer" SEED_REFERENCE_REPEAT=1 scripts/gpu_run.sh setup seed
mv $R/summary.log $R/summary1.log; pack
DEADLINE_S=$(( ${D:-560} - SECONDS )) SEED_MARGIN_S=10 SEED_TAG=rest SEED_ARGS="--op write_back,load_all" SEED_REFERENCE_REPEAT=1 scripts/gpu_run.sh seed
mv $R/summary.log $R/summary2.log; kill %1; pack
cat $R/summary1.log $R/summary2.log
