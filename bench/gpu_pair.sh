#!/usr/bin/env bash
# Two `bench/gpu_run.sh` runs side by side, one per GPU of an nvidia-h200-x2 lease (the trainer keeps every text's
# features on its GPU, ~70 GB for 1055 texts: one training per GPU). Each side's settings are a string of
# assignments, evaluated in that side's shell:
#   bash bench/gpu_pair.sh 'TRAIN_INIT=1 TRAIN_TTT=1' 'TRAIN_INIT=1 TRAIN_TTT=1 TRAIN_LAYERS=2' train recall
#   bash bench/gpu_pair.sh 'HEAD=/tmp/oasis-a-head' 'HEAD=/tmp/oasis-b-head' recall    # later, same lease
# Side a runs on GPU 0, side b on GPU 1, each with its own TRAIN_DIR (/tmp/oasis-{a,b}-train), HEAD_OUT
# (/tmp/oasis-{a,b}-head), GEN_DIR (/tmp/oasis-{a,b}-gen) and OUT ($OUT/a, $OUT/b). Full logs: /tmp/gpu-pair-{a,b}.log
# (their ends printed). A side's settings may set PARTS="..." to run other parts than the command line's, e.g.
#   bash bench/gpu_pair.sh 'TRAIN_INIT=1 TRAIN_LAYERS=2' 'PARTS="gendata train" GEN_GREEDY=1 TRAIN_DATA=...' train
# gpu.txt, train.log and gendata.log are not kept (at most 8 files come back from a call: `train` from $HEAD
# then returns 3 per side, 4 with TRAIN_LAYERS; `recall` 2 JSON files per budget).
set -uo pipefail
OUT=${OUT:-/tmp/out}
settings=("$1" "$2")
shift 2
for i in 0 1; do
  side=$([ "$i" = 0 ] && echo a || echo b)
  (
    export CUDA_VISIBLE_DEVICES=$i OUT="$OUT/$side" TRAIN_DIR=/tmp/oasis-$side-train HEAD_OUT=/tmp/oasis-$side-head \
      GEN_DIR=/tmp/oasis-$side-gen
    eval "export ${settings[$i]}"
    if [ -n "${PARTS:-}" ]; then bash bench/gpu_run.sh $PARTS; else bash bench/gpu_run.sh "$@"; fi
  ) > "/tmp/gpu-pair-$side.log" 2>&1 &
done
wait
rm -f "$OUT"/[ab]/gpu.txt "$OUT"/[ab]/train.log "$OUT"/[ab]/gendata.log
for side in a b; do echo "== side $side: ${settings[$([ $side = a ] && echo 0 || echo 1)]}"; grep -v Warning "/tmp/gpu-pair-$side.log" | tail -n 14; done
