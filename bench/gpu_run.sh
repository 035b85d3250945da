#!/usr/bin/env bash
# The GPU runs, in one device call: `bash bench/gpu_run.sh <part> ...` runs the named parts in order; logs and JSON
# under $OUT. Decode benchmarks interleave their methods step by step (`bench/decode.py --interleave`).
#   tests / testseager   the CUDA tests (captured steps, as by default / every step eager)
#   resultstable         the README's speed table: dense eager / compiled, HF offload, oasis, compiled steps at 32K x 1,
#                        32K x 4, 128K x 1 (Qwen3-8B shape, random weights; ~9 minutes on an H200)
#   captured             its first part: 32K x {1, 4} (CAPTURED_BATCHES="1" or "4" runs one)
#   budgetbound          32K x 4 at budgets 2048 / 1024 / 512 (the step against the bytes fetched), 32K x 1 compiled
#   beforeafter          the captured 32K x 1, 32K x 4, 128K x 1 and capped 128K rows of this tree and of the tree in
#                        $BEFORE (an earlier commit's `git archive` of oasis_cache and bench), alternating, each in a
#                        process of its own (BEFORE_ROWS="32k1 32k4 128k capped" picks rows)
#   hostdtype            the host pool in the model's dtype, fp8 and int4 side by side (`host_dtype`): 32K x 1 and
#                        32K x 4 with "previous" and the default ("none" without a draft head), replayed steps
#                        (HOSTDTYPE_ROWS="32k1 32k4 128k" picks rows; 128K x 1 with "previous")
#   gather               the gather kernel alone, each host dtype, the side stream's shapes and one program a block,
#                        idle and beside matmuls (`bench/gather.py`, 32K x 4 of a Qwen3-8B layer)
#   hostnll              decode-mode NLL of Qwen2.5-Coder-0.5B at full budget and 1/16, each host dtype, 8K 16K 32K
#   capacity32k / capacity128k / capped128k   the largest batch under a 24 GiB cap (CAPS, METHODS, BATCHES, TAG,
#                        BENCH_MODEL=qwen25-coder-0.5b PROMPT=code for real weights), 128K x 1 under the cap
#   prefill              the prefill against dense's (PREFILL_BATCHES, PREFILL_GENERATE=1: through generate)
#   firstcall / firstcallwarmed   a process's first generate against its later ones on a new kernel cache, without
#                        and with `python -m oasis_cache.warm` first
#   gptoss / gptosscompiled / gemma2 / mla   other attention forms (sinks, soft-capping, latent) beside dense
#   disagg / disaggqwen  the remote tier through Mooncake Store (bench/mooncake_for_gpu.sh: carry .mc; DISAGG_STORAGE=2:
#                        two storage processes)
#   suite / qwenreport / qwenrecall / qwenindecodepar / qwenheadsrecall / train   quality (eval/), recall, the long
#                        in-decode generation, a draft head's training (OASIS_SMOLLM2_GGUF / OASIS_QWEN05_GGUF set)
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HEAD=${HEAD:-oasis_cache/draft/heads/smollm2-135m-instruct}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for arg in "$@"; do
  case "$arg" in
    tests) python3 -c "import xdist" 2>/dev/null && X="-n 2" || X=""  # (two processes on the card: 251 s against 521 in one, H200, 2026-12-05)
      python3 -m pytest -q $X -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25 ;;
    testseager) OASIS_TEST_CUDA_GRAPH=0 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu-eager.log" | tail -25 ;;
    captured) for spec in "1:dense offload oasis-previous oasis-previous-captured oasis-exact-captured" "4:dense offload oasis-previous oasis-previous-captured"; do [[ " ${CAPTURED_BATCHES:-1 4} " == *" ${spec%%:*} "* ]] || continue; python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches "${spec%%:*}" --budget 2048 --steps 48 --warmup 4 --measure-steps 0 --statistic mean --methods ${spec#*:} --out "$OUT/decode-qwen3-8b-32k-b${spec%%:*}-captured.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-captured-b${spec%%:*}.log" | tail -7; done ;;
    resultstable) bash "$0" captured  # README "Results" (~540 s on the H200): the rows above, 128K's dense and oasis, dense compiled, the compiled steady state
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 24 --warmup 4 --measure-steps 0 --statistic mean --prefill-chunk 32768 --methods dense oasis-previous-captured --out "$OUT/decode-qwen3-8b-128k-captured.json" 2>&1 | grep --line-buffered -v Warning | tail -3
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 4 --steps 12 --warmup 3 --measure-steps 0 --methods dense dense-compiled --out "$OUT/decode-qwen3-8b-32k-compiled.json" 2>&1 | grep --line-buffered -v Warning | tail -5
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 --budget 2048 --steps 32 --warmup 8 --measure-steps 0 --methods oasis-previous-captured oasis-previous-captured@compiled --out "$OUT/decode-qwen3-8b-32k-b1-compiled.json" 2>&1 | grep --line-buffered -v Warning | tail -3
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 24 --warmup 8 --measure-steps 0 --prefill-chunk 32768 --methods oasis-previous-captured@compiled --out "$OUT/decode-qwen3-8b-128k-b1-compiled.json" 2>&1 | grep --line-buffered -v Warning | tail -2 ;;
    budgetbound) for budget in 2048 1024 512; do
        python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 4 --budget $budget --steps 32 --warmup 8 --measure-steps 4 --methods oasis-previous-captured --out "$OUT/decode-qwen3-8b-32k-b4-budget$budget.json" 2>&1 | grep -v Warning | tail -1 | sed "s/^/32K x 4, budget $budget: /"; done
      for budget in 2048 1024 2048 1024; do  # 32K x 1 compiled steps, alternating budgets in sibling processes
        python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 --budget $budget --steps 32 --warmup 8 --measure-steps 0 --methods oasis-previous-captured@compiled --out "$OUT/decode-qwen3-8b-32k-b1-compiled-budget$budget-$SECONDS.json" 2>&1 | grep -v Warning | tail -1 | sed "s/^/32K x 1 compiled, budget $budget: /"; done ;;
    beforeafter) for row in ${BEFORE_ROWS:-32k1 32k4 128k capped}; do case $row in
        32k1) a="--interleave --contexts 32768 --batches 1 --steps 48 --warmup 4 --statistic mean" ;;
        32k4) a="--interleave --contexts 32768 --batches 4 --steps 48 --warmup 4 --statistic mean" ;;
        128k) a="--interleave --contexts 131072 --batches 1 --steps 24 --warmup 4 --statistic mean --prefill-chunk 32768" ;;
        capped) a="--contexts 131072 --batches 1 --steps 8 --warmup 2 --memory-cap-gib 24" ;; esac
        for tree in after before; do root=$PWD; [ $tree = before ] && root=$(cd "$BEFORE" && pwd)
          (cd "$root" && PYTHONPATH=$root:$root/tests python3 bench/decode.py --model qwen3-8b --budget 2048 --measure-steps 0 $a --methods oasis-previous-captured --out "$OUT/beforeafter-$row-$tree.json" 2>&1 | grep --line-buffered -v Warning | tail -1 | sed "s/^/$row $tree: /"); done; done ;;
    hostdtype) for row in ${HOSTDTYPE_ROWS:-32k1 32k4 128k}; do m=""; for v in "" @fp8 @int4; do m="$m oasis-previous-captured$v"; done
        case $row in 32k1|32k4) for v in "" @fp8 @int4; do m="$m oasis-none-captured$v"; done ;; esac
        case $row in
          32k1) a="--contexts 32768 --batches 1 --steps 48 --warmup 4" ;;
          32k4) a="--contexts 32768 --batches 4 --steps 48 --warmup 4" ;;
          128k) a="--contexts 131072 --batches 1 --steps 24 --warmup 4 --prefill-chunk 32768" ;; esac
        python3 bench/decode.py --interleave --model qwen3-8b --budget 2048 --measure-steps 0 $a --methods $m --out "$OUT/decode-qwen3-8b-hostdtype-$row.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-hostdtype-$row.log" | tail -8; done ;;
    gather) python3 bench/gather.py --context 32768 --batch 4 --budget 2048 --out "$OUT/gather-32k-b4.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/gather.log" ;;
    hostnll) for n in ${HOSTNLL_PREFILLS:-8192 16384 32512}; do python3 eval/report.py --model qwen25-coder-0.5b --dtype bfloat16 --tasks --nll-prefill $n --nll-tokens ${HOSTNLL_TOKENS:-256} --modes none none@fp8 none@int4 --fractions 1 16 --out "$OUT/nll-hostdtype-qwen05-$n.json" 2>&1 | grep --line-buffered -v Warning | tail -9; done ;;
    capacity32k) python3 bench/capacity.py --model ${BENCH_MODEL:-qwen3-8b} --prompt ${PROMPT:-random} --contexts 32768 --caps ${CAPS:-24 0} --methods ${METHODS:-dense dense-chunked dense-compiled offload oasis} --batches ${BATCHES:-1 2 4 8 16} --new-tokens 24 --try-timeout 120 --out "$OUT/capacity-${BENCH_MODEL:-qwen3-8b}-32k${CAPS:+-cap${CAPS// /-}}${TAG:-}.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/capacity-32k${CAPS:+-cap${CAPS// /-}}${TAG:-}.log" ;;
    capacity128k) python3 bench/capacity.py --model qwen3-8b --contexts 131072 --caps ${CAPS:-24 0} --methods ${METHODS:-dense dense-chunked dense-compiled offload oasis} --batches ${BATCHES:-1 2 4} --new-tokens 24 --try-timeout 150 --out "$OUT/capacity-qwen3-8b-128k${CAPS:+-cap${CAPS// /-}}${TAG:-}.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/capacity-128k${CAPS:+-cap${CAPS// /-}}${TAG:-}.log" ;;
    capped128k) python3 bench/decode.py --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 8 --warmup 2 --measure-steps 0 --memory-cap-gib 24 --methods oasis-previous-captured --out "$OUT/decode-qwen3-8b-128k-capped24-defaults.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-capped128k.log" | tail -4 ;;
    prefill) for b in ${PREFILL_BATCHES:-1 4}; do python3 bench/prefill.py --model qwen3-8b --device cuda --context 32768 --batch $b --repeats 3 --profile "${PREFILL_PROFILE:-25}" ${PREFILL_GENERATE:+--generate} --out "$OUT/prefill-qwen3-8b-32k-b$b${PREFILL_GENERATE:+-generate}.json" 2>&1 | grep --line-buffered -v Warning | tail -5; done ;;
    firstcall) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 2 --fresh-kernel-cache --out "$OUT/first-call-qwen3-8b-32k.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call.log" ;;
    firstcallwarmed) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 2 --fresh-kernel-cache --warm-first --out "$OUT/first-call-qwen3-8b-32k-warmed.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-warmed.log" ;;
    gptoss) python3 bench/decode.py --interleave --model gpt-oss-20b --contexts ${GPTOSS_CONTEXT:-32768} --batches 1 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --prefill-chunk 1024 --methods dense oasis-previous oasis-previous-captured --out "$OUT/decode-gpt-oss-20b.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-gptoss.log" | tail -6 ;;  # learned sinks: dense is HF's eager attention (gpt-oss has no SDPA path)
    gptosscompiled) python3 bench/decode.py --interleave --model gpt-oss-20b --contexts ${GPTOSS_CONTEXT:-32768} --batches 1 --steps 12 --warmup 3 --measure-steps 0 --prefill-chunk 1024 --methods dense dense-compiled --out "$OUT/decode-gpt-oss-20b-compiled.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-gptoss-compiled.log" | tail -6 ;;  # the fair dense baseline for gptoss: StaticCache + torch.compile (eager attention: gpt-oss has no SDPA path), a process of its own
    gemma2) python3 bench/decode.py --interleave --model gemma-2-2b --contexts 8192 --batches 1 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --prefill-chunk 2048 --methods dense oasis-previous oasis-previous-captured --out "$OUT/decode-gemma-2-2b.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-gemma2.log" | tail -6 ;;  # soft-capping on explicit scores, eager and captured; dense is HF's eager (no SDPA path)
    mla) python3 bench/decode.py --interleave --model deepseek-v2-lite --contexts ${MLA_CONTEXT:-32768} --batches 1 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --prefill-chunk 4096 --methods dense oasis-previous oasis-previous-captured --out "$OUT/decode-deepseek-v2-lite.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-mla.log" | tail -6 ;;  # latent attention (a prefill expanded, steps absorbed), eager and captured, beside HF's SDPA over the expanded heads
    disagg) python3 bench/disagg.py --device cuda --context 32768 --budget 2048 --steps 32 --layers 4 --segment 4GB ${DISAGG_STORAGE:+--storage $DISAGG_STORAGE} --out "$OUT/disagg-qwen3-8b-kv-32k.json" 2>&1 | grep --line-buffered -v "^[IWE]1\|Warning" | tee "$OUT/disagg.log" | tail -3
      python3 bench/disagg.py --device cuda --context 32768 --budget 2048 --steps 32 --layers 4 --segment 4GB ${DISAGG_STORAGE:+--storage $DISAGG_STORAGE} --measure --out "$OUT/disagg-qwen3-8b-kv-32k-measure.json" 2>&1 | grep --line-buffered -v "^[IWE]1\|Warning" | tee "$OUT/disagg-measure.log" | tail -4 ;;
    disaggqwen) for d in ${DISAGG_MODES:-auto overlap off}; do python3 bench/disagg.py --model qwen25-coder-0.5b --device cuda --dtype bfloat16 --context 32768 --budget 2048 --steps 128 --segment 4GB ${DISAGG_STORAGE:+--storage $DISAGG_STORAGE} --deferred ${d/overlap/on} $([ $d = overlap ] && echo --overlap) ${DISAGG_SETS:+--local-cache-sets $DISAGG_SETS} --out "$OUT/disagg-qwen05-32k-$d.json" 2>&1 | grep --line-buffered -v "^[IWE]1\|Warning\|Loading" | tee "$OUT/disagg-qwen05-$d.log" | tail -4; done ;;
    suite) python3 eval/suite.py --out "$OUT/suite" ${SUITE_ARGS:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/suite.log" | tail -80 ;;
    qwenreport) python3 eval/report.py --model qwen25-coder-0.5b --dtype "${REPORT_DTYPE:-bfloat16}" --tasks ${REPORT_TASKS:-single_needle multikey multivalue variable_tracking frequent_words} --filler noise --lengths ${REPORT_LENGTHS:-8192 16384 32768} --samples "${REPORT_SAMPLES:-24}" --batch-size 8 --fractions ${REPORT_FRACTIONS:-16 32} --modes ${REPORT_MODES:-none previous} ${REPORT_HEAD:+--head "$HEAD"} --nll-prefill 7936 --nll-tokens "${REPORT_NLL_TOKENS:-256}" --out "$OUT/report-qwen05${REPORT_TAG:-}.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/report-qwen05${REPORT_TAG:-}.log" | tail -40 ;;
    qwenrecall) for context in ${RECALL_CONTEXTS:-8000 16000}; do for k in ${RECALL_KS:-sixteenth}; do
        if [ "$k" = sixteenth ]; then budget=$(( (context / 16 + 15) / 16 * 16 )); tag=; else budget=$(( (k + 1) * 16 )); tag=-k$k; fi
        python3 eval/recall.py --model qwen25-coder-0.5b ${REPORT_HEAD:+--head "$HEAD" --oracle} ${RECALL_TEXT:+--text "$RECALL_TEXT"} ${RECALL_LOOKUP:+--draft-lookup $RECALL_LOOKUP} --context $context --budget $budget ${RECALL_SLOTS:+--slots $RECALL_SLOTS} --steps ${RECALL_STEPS:-64} --sequences 1 --out "$OUT/recall-qwen05-$context$tag${RECALL_TAG:-}.json" 2>&1 | grep --line-buffered -v Warning | tail -5; done; done ;;
    qwenindecodepar) N=${INDECODE_TOKENS:-4096}; D=$OUT/in-decode-dense-$N.pt; files=()  # dense once (kept in $D, which comes back: carry it and set INDECODE_DENSE to skip it next time), then one process per (mode, budget)
      [ -n "${INDECODE_DENSE:-}" ] && cp "$INDECODE_DENSE" "$D"
      common="--model qwen25-coder-0.5b --prompts ${INDECODE_PROMPTS:-8} --new-tokens $N --dense $D ${REPORT_HEAD:+--head $HEAD}"
      python3 eval/in_decode.py $common --modes --out "$OUT/in-decode-qwen05-$N-dense.json" 2>&1 | grep --line-buffered -v Warning | tail -3
      [ -n "${INDECODE_DENSE_ONLY:-}" ] && continue
      for mode in ${INDECODE_MODES:-none previous}; do for f in ${INDECODE_FRACTIONS:-8 16}; do
        python3 eval/in_decode.py $common --modes $mode --fractions $f --out "$OUT/in-decode-qwen05-$N-$mode-$f.json" > "$OUT/in-decode-qwen05-$N-$mode-$f.log" 2>&1 &
        files+=("$OUT/in-decode-qwen05-$N-$mode-$f.json"); done; done; wait
      python3 eval/in_decode.py --merge "${files[@]}" --out "$OUT/in-decode-qwen05-$N.json" | tee "$OUT/in-decode-qwen05-$N.log" ;;
    qwenheadsrecall)  # recall of $NEW_HEAD beside the shipped one ($QWEN_HEAD): 16K docs and 32K code, 4 jobs at once
      for h in "new:$NEW_HEAD" "shipped:${QWEN_HEAD:-oasis_cache/draft/heads/qwen2.5-coder-0.5b-instruct}"; do for t in docs:16000 code:32000; do
        HEAD=${h#*:} REPORT_HEAD=1 RECALL_LOOKUP=${RECALL_LOOKUP:-0 2 2+arbiter} RECALL_KS=${RECALL_KS:-sixteenth 20} RECALL_TEXT=${t%%:*} RECALL_CONTEXTS=${t#*:} RECALL_TAG=-${h%%:*}-${t%%:*} bash "$0" qwenrecall > "$OUT/recall-${h%%:*}-${t%%:*}.log" 2>&1 & done; done; wait
      tail -n 5 "$OUT"/recall-*.log ;;
    train) TD=${TRAIN_DIR:-/tmp/oasis-train} HO=${HEAD_OUT:-/tmp/oasis-head}
      python3 -m oasis_cache.draft.train --target "${TARGET:-smollm2}" --out "$TD" --documents 400 --document-tokens 4096 --generate-batch 64 --cache-features --steps "${TRAIN_STEPS:-20000}" --save-every 1000 --draft-vocab 8192 --time-limit "${TRAIN_SECONDS:-480}" ${TRAIN_INTERMEDIATE:+--intermediate-size "$TRAIN_INTERMEDIATE"} ${TRAIN_DTYPE:+--dtype "$TRAIN_DTYPE"} ${TRAIN_RESUME:+--resume} ${TRAIN_INIT:+--init-head "$HEAD"} ${TRAIN_DATA:+--data $TRAIN_DATA} ${TRAIN_SOURCE:+--document-source "$TRAIN_SOURCE"} ${TRAIN_CROP:+--crop "$TRAIN_CROP"} ${TRAIN_TTT:+--ttt "$TRAIN_TTT"} ${TRAIN_WEIGHT:+--confidence-weight "$TRAIN_WEIGHT"} ${TRAIN_LAYERS:+--layers "$TRAIN_LAYERS"} ${TRAIN_SCHEDULE:+--lr-schedule "$TRAIN_SCHEDULE"} ${TRAIN_LR:+--lr "$TRAIN_LR"} ${TRAIN_SEED:+--seed "$TRAIN_SEED"} --quiet 2>&1 | grep --line-buffered -v Warning | tee "$OUT/train.log" | tail -8
      python3 -c "
import torch, sys; from oasis_cache.draft import load_eagle3, save_eagle3
save_eagle3(load_eagle3('$TD/head').to(torch.bfloat16), '$HO')"
      mkdir -p "$OUT/head" && cp "$TD/head/target.json" "$HO/" && cp "$TD/metrics.json" "$OUT/head/" && split -b 15000000 "$HO/model.safetensors" "$OUT/head/part"
      { [ -z "${TRAIN_INIT:-}" ] || [ -n "${TRAIN_LAYERS:-}" ]; } && cp "$HO/config.json" "$OUT/head/"  # else $HEAD's
      [ -z "${TRAIN_INIT:-}" ] && cp "$HO/target.json" "$OUT/head/"  # from $HEAD: its target
      [ -z "${TRAIN_DATA:-}" ] && cp "$TD/data.pt" "$OUT/head/"; HEAD=$HO ;;
    *) echo "unknown part: $arg (see the header of $0)" >&2; exit 2 ;;
  esac
done
