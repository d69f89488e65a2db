#!/usr/bin/env bash
# session 32, GPU call 2 (same warm machine): the seed's layer_first per-layer and all-layer
# loads with nothing running beside them, then the rest of the seed's per-layer rows.
set -u
TOTAL=${TOTAL:-560}
FINAL=$OUT
export OUT=/tmp/g2
R=$OUT/results
mkdir -p $R
t0=$SECONDS
left() { echo $((TOTAL - SECONDS + t0)); }
pack() { tar -C $OUT -czf $FINAL/results.tar.gz results; }
python3 -c "import kvcore, kvio_cuda" 2>/dev/null || DEADLINE_S=100 scripts/gpu_run.sh setup
[ -f $R/summary.log ] && mv $R/summary.log $R/summary0.log
SEED_TAG=lf_loads SEED_LAYOUTS=layer_first SEED_ARGS="--op load_layer,load_all --num-layers 16,24,48,80" SEED_REFERENCE_REPEAT=1 SEED_MARGIN_S=10 DEADLINE_S=$(( $(left) - 10 )) scripts/gpu_run.sh seed
mv $R/summary.log $R/summary1.log; pack
cat $R/summary*.log
