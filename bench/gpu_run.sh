#!/usr/bin/env bash
# GPU checks and benchmarks, one device call: `bash bench/gpu_run.sh tests bench ...` runs the named parts in order.
#   tests     CUDA tests (SmolLM2 included when its GGUF is at $OASIS_SMOLLM2_GGUF)
#   testsdiag  the CUDA tests up to four times (as is, again, OMP_NUM_THREADS=16, OASIS_TEST_GC_CHECK=1), stopping at
#             the first run with a failure: which test leaves a pending CUDA error (twenty-ninth session)
#   testseager  the same with every OasisCache made with cuda_graph=False (OASIS_TEST_CUDA_GRAPH=0, conftest.py): the
#             eager decode path, which the default (captured steps) takes only where a step cannot be replayed
#   exact32k  exactness of a Qwen3-8B-shaped random model at 32K (fp32)
#   bench     decode benchmark at 32K x {1, 4};  bench128k  at 128K x 1;  capped  a 24 GiB card at 64K
#   resultstable  README "Results": dense eager / compiled, HF offload, oasis at 32K x {1, 4} and 128K x 1, and oasis's
#             compiled steady state (~540 s on the H200: one call)
#   budgetbound  32K x 4 at budgets 2048 / 1024 / 512 (step time against the bytes fetched) and 32K x 1 compiled steps
#             at 2048 / 1024 alternating (~270 s on the H200)
#   gptoss    a gpt-oss-20b-shaped random model (learned sinks, sliding layers) at 32K x 1: dense eager, oasis
#   gptosscompiled  its dense baseline compiled (StaticCache + torch.compile, a process of its own), beside dense eager
#   profilegptoss  its steps under the profilers (kernel and host tables), dense eager and oasis-previous
#   capacity32k / capacity128k  bench/capacity.py: the largest batch under a 24 GiB cap and uncapped (CAPS="24" or
#             "0" runs one of them; BATCHES, METHODS override the batches and methods tried, TAG names the files), dense (eager,
#             compiled), HF offload, oasis, through model.generate, with its tok/s (issue 21's equal-memory table);
#             capacity32k takes BENCH_MODEL=qwen25-coder-0.5b PROMPT=code: a real model on real text (a stable
#             selection, where random weights select anew each step; oasis rows carry the hit rate, critical MB)
#   disaggqwen  bench/disagg.py with Qwen2.5-Coder-0.5B's real weights at 32K (OASIS_QWEN05_GGUF set): store reads
#             deferred (captured steps), deferred and overlapped with the step (--overlap), during the step (eager),
#             against the local pool; Mooncake from
#             bench/mooncake_for_gpu.sh (carry .mc, see its header)
#   disagg    bench/disagg.py on CUDA: admission bytes, decode-side host bytes, remote fetches, TPOT remote vs local;
#             then again in measurement mode (--measure: exposed wait per step, eager steps)
#             (needs Mooncake's CUDA wheel on the machine: mooncake-transfer-engine, carried in)
#   qwenhead  issue 22's recall target: `train` with TARGET=qwen25-coder-0.5b on documentation and package code
#             (TRAIN_SOURCE, default mixed+code; TRAIN_SECONDS counts the texts' generation, ~7 min), then eval/recall.py
#             at 16K (documentation) and 32K (code) for the new head and the shipped one (QWEN_HEAD), four processes,
#             each at K = 1/16 of the context and K = 20 blocks (RECALL_KS, default "sixteenth 20"),
#             eagle3 rows with the n-gram lookup off, on, on with its arbiter (RECALL_LOOKUP, default "0 2 2+arbiter");
#             longer than one call: start it with bench/gpu_bg.sh
#   qwenheadsrecall  qwenhead's recall half for a head trained before: NEW_HEAD=<dir> beside the shipped one
#             (RECALL_STEPS=256: four times the default's decode steps, less noise from one window)
#   suite     eval/suite.py: issue 22's whole quality suite (both models, every task, modes, budgets; 4 processes at
#             once), its wall time and tables; OASIS_SMOLLM2_GGUF and OASIS_QWEN05_GGUF set, SUITE_ARGS more options
#             (e.g. "--models qwen25-coder-0.5b --lengths 32768"); longer than one call: start it with bench/gpu_bg.sh
#   qwenindecode / qwenreport / qwenrecall  issue 22 on Qwen2.5-Coder-0.5B (OASIS_QWEN05_GGUF set; the GGUF carried in
#             nine parts, ../shared/tools/qwen05-parts.sh): the in-decode workload (eval/in_decode.py), the quality
#             suite at 8K-32K, recall at 8K and 16K (the documentation's held-out region is 16K tokens;
#             RECALL_TEXT=code RECALL_CONTEXTS="16000 32000": the standard library's code; RECALL_KS="sixteenth 20": K
#             = 1/16 of the context, K = 20 blocks; RECALL_SLOTS=40: the slots the prediction fills, 2K as the
#             default exact mode has them at K = 20; RECALL_STEPS: decode steps, 64 by default); REPORT_HEAD=1
#             adds eagle3 with $HEAD. train / gendata take TARGET=qwen25-coder-0.5b for its head (TRAIN_INTERMEDIATE=2048 keeps it
#             ≤ 40 MB, TRAIN_DTYPE=bfloat16 the target's dtype). qwenindecodepar / qwenreportpar: the same work as
#             processes side by side on the GPU (one per (mode, budget) after dense's pass; one per length);
#             qwenreporttasks: one process per task at one length (REPORT_LENGTHS=32768: a whole length in one call;
#             five at once at 32K ran two out of memory: REPORT_PARALLEL, default 3, at once); REPORT_DTYPE: bfloat16 unless
#             set (in float32 dense's SDPA at 32K x 8 asks for 450 GiB);
#             qwenindecodeprompts: one process per prompt, each an unpadded batch of one (captured decode steps),
#             each recomputing dense eagerly: 8 of them at 4096 tokens did not finish one oasis row in 545 s (the
#             nineteenth session); prefer qwenindecodepar (dense once as a padded batch, kept in $OUT; padded batches
#             replay captured steps since the eighteenth)
#   firstcall  bench/first_call.py: a process's first generate against its later ones, a new machine's kernel cache
#   firstcallwarmed  the same after `python -m oasis_cache.warm` ran in that new kernel cache (a machine warmed once)
#   firstcallcold  first calls with the driver's JIT cache off and on (COLD_MODES), oasis and dense
#   firstcallsplitwarm  the first chunk's warm-up of cuDNN's kernels (SPLITWARM_MODES: its queries, 0 none), alternating
#   firstcallunaligned  firstcall's first process with a 32,000-token prompt (CONTEXT): 2,000 blocks, not a power of two
#   firstcallwarm  the parts of Triton's start-up the first prefill's thread pays (WARM_MODES), alternating
#   firstcallregions  the prefill's host chunks in the package's own region (research) against torch's (REGION_MODES)
#   firstcallprofile  cProfile of a later call (call 2) of one process
#   chunkattention  bench/chunk_attention.py: a chunk over its past, lower-right mask against cuDNN's two parts merged
#   pinnedhuge  bench/pinned_alloc.py: 5 GiB pinned by torch (fast_pinning) against memory mapped with transparent huge
#             pages and registered (PINNED_CASES)
#   compiletimes  bench/compile_times.py --together on this host's CPU: each kernel's compilation, all serially, all in threads
#   prefillpeak  bench/prefill_peak.py: a capped 32K x PEAK_BATCH prefill per variant (PEAK_VARIANTS), its error and peak
#   capped128k  a 24 GiB card at 128K x 1 with the package's defaults: no --prefill-chunk (the cache chunks the prefill)
#   compiled  dense, dense-compiled (StaticCache + torch.compile "reduce-overhead": CUDA graphs) and offload at 32K x
#             {1, 4}: what a captured decode step gives (the ceiling for a captured oasis step)
#   gather    gather bandwidth;  programs  32K x 4 with 64 gather programs;  profile  kernel table, 32K x 4
#   train     the SmolLM2 EAGLE-3 head (TRAIN_SECONDS, default 480; TRAIN_RESUME=1 continues $TRAIN_DIR;
#             TRAIN_INIT=1 starts from $HEAD, the shipped head; TRAIN_SEED another draw of texts; TRAIN_DATA="FILE ..." reuses earlier runs' data.pt;
#             TRAIN_SOURCE=docs|docstrings|mixed: where the long windows come from, default docs; TRAIN_CROP=ROWS:
#             train each text on a window of at most ROWS rows, half at its end; TRAIN_TTT, TRAIN_LR,
#             TRAIN_SCHEDULE=constant|cosine, TRAIN_WEIGHT (γ: rows weighted by the target's top-1 probability^γ),
#             TRAIN_STEPS (default 20000), TRAIN_LAYERS (a deeper head; from $HEAD:
#             the added layers start as the identity): the trainer's options; TRAIN_DIR, default
#             /tmp/oasis-train),
#             kept in $HEAD_OUT (default /tmp/oasis-head), returned in bf16 under $OUT/head: metrics.json, the
#             safetensors split in 15 MB parts (`cat part* > model.safetensors`), config and target unless it
#             started from $HEAD (TRAIN_INIT: the same as $HEAD's), data.pt unless TRAIN_DATA gave it
#   gendata   only texts for training: GEN_DOCUMENTS (default 400) windows of GEN_SOURCE (default mixed) with a question,
#             no chats, seed GEN_SEED (default 1), each answered by SmolLM2 (GEN_PLAIN=1: no question, continued as plain
#             text; GEN_GREEDY=1: greedy answers, not sampled) -> $GEN_DIR/data.pt (default /tmp/oasis-gen; and $OUT); pass
#             it to `train` with TRAIN_DATA="old.pt /tmp/oasis-gen/data.pt" (several files: each keeps its held-out split)
#   recall    eval/recall.py with that head (rows none, previous, eagle3, eagle3-head: no chained drafts, and the
#             perfect draft; document and chat prompts; RECALL_BUDGETS, default "336 512": K = 20, 31;
#             RECALL_SEQUENCES windows of the held-out documentation as one batch, default 4; RECALL_LOOKUP: the
#             eagle3 rows' draft_lookup, default the package's)
#   report    eval/report.py at 4K: every task, budget 1/8, modes none (bits scorer), none@bound, previous, eagle3
#   report8k  eval/report.py at 8K: needle, passkey, multikey tasks, budgets 1/8 and 1/16, NLL over 8K
#   noise     eval/report.py at 4K on RULER's noise filler (where SmolLM2 finds the needle), budget 1/8, NLL over 8K
#   halfquality  the full run's tasks and NLL with modes none@full (summaries on every key channel) and none (half of
#             them, the default since the eleventh session)
#   full      the README's quality run: six tasks x 48 samples (288 documents) at 4K on the noise filler, budget 1/8,
#             every mode and the bound scorer, NLL over 8K; budgets  the same at 1/4, 1/8, 1/16 for two tasks
#   scoring   eval/scoring.py: block scorers compared by retention (4K, budget 1/8)
#   scorers   decode benchmark at 32K x {1, 4}: the bits scorer's cost against the bound's
#   firstcallahead  `firstcall` with compile_ahead=True (a dry first decode step compiles its kernels in parallel)
#   fusedmemory  bench/fused_memory.py: allocated bytes per new token with and without fuse_projections (8 of Qwen3-8B's
#             layers; the blocks alive with their frames): a copy of a fused cache once doubled the fused buffers
#   firstcallnoahead  `firstcall` with compile_ahead=False (each kernel compiles at its first launch: the default
#             before the fortieth session)
#   firstcallcompiled  `firstcall` with compile_decode=True (its compilation in the first generate)
#   cappedauto  `capped128k` through the default's switch to compiled steps (`@compiledsoon`: at the 4th step)
#   firstcallauto  the default compile_decode=None over 6 calls of 512 tokens at 32K x 1: compiled at the 2048th step (call 5)
#   profilecompiled  kernel groups of the captured `previous` step with and without compile_decode, 32K x 1
#   launchkeys  bench/launch_keys.py on CUDA, random Qwen3-8B at 32K: what compiles at which forward, on an empty kernel cache
#   besidegather  the select, block scores and matmul benches with the gather beside each call (bench/beside_gather.py)
#   grouped  bench/matmul.py --grouped at M = 1 and 4: the grouped kernel's tuning grid against cuBLAS (~5 min)
#   profile128k  kernel table of a compiled 128K x 1 step, the gather on 32 (default) and 64 programs
#   gatherprograms  32K and 128K x 1, compiled steps (the default's steady state) with the side stream's gather on 16,
#             32 (the package's choice on an H200) and 64 programs (thirty-seventh session: 32 = 16 < 64; programs of
#             fewer warps lost too and their option was removed) (~4.5 min)
#   compiledfused  32K x {1, 4} decode, compile_decode with and without fuse_projections (q/k/v, gate/up one product)
#   recompiles  bench/recompiles.py: dynamo's recompile reasons and graph breaks for compile_decode (10 layers)
#   matmul    bench/matmul.py: a layer's weight matmuls alone (cuBLAS), separate and with q/k/v, gate/up fused, M = 1, 4
#   selectkernels  bench/select_kernels.py: top-k (the select kernel against torch.topk + sort), slot assignment,
#             graph-replayed calls
#   selectsegments  the same, the two-stage select's segments (1: one stage) at 2,176-17,408 blocks a row
#   scorekernel  bench/score_kernel.py at a captured 32K and 128K x 1 step's shape: tiles and warps
#   profiletopk  the same with compile_decode, torch.topk (`@compiledtorchtopk`) against the package's select kernel
#             (top_k_kernel, the default), 32K x 1 and 48K x 1 (thirty-first session: 8.4 -> 8.1 ms, 8.8 -> 8.5 ms)
#   profile3  wall / device / CPU time per step and kernel tables: previous vs eagle3 at 32K x 1 (the ride-along's cost)
#   eagle3    decode benchmark at 32K x {1, 4}: dense, previous, eagle3-plain, eagle3 (the ride-along's cost, without
#             and with the head's CUDA graph; interleaved, so every oasis method holds its own host pool: 18 GiB each
#             at 32K x 4)
#   captured  decode benchmark at 32K x {1, 4}: steady decode steps replayed as CUDA graphs (oasis-previous-captured,
#             oasis-exact-captured at x 1) against dense, offload and eager oasis-previous; mean TPOT over 48 steps (3
#             block periods: recaptures included); one process per batch (five caches at 32K x 4 exhaust host memory);
#             CAPTURED_BATCHES="1" or "4" runs one of them
#   captured128k  the same at 128K x 1 (dense, oasis-previous, oasis-previous-captured), then dense and HF offload in a
#             second process (four host copies of a 128K cache do not fit the host's memory: OOM-killed when tried)
#   capturedeagle3  the eagle3 ride-along inside the captured step, 32K x {1, 4}: dense, oasis-previous-captured,
#             oasis-eagle3-exact (what OasisCache(model) picks with a head) eager and captured; means over 48 steps
#   compileddecode  compile_decode=True (the layers' own work torch.compile'd, compute/compiled_layers.py) against the
#             captured default, 32K x {1, 4}: dense, oasis-previous-captured[@compiled], oasis-eagle3-exact-captured[@compiled]
#   half      summaries on half the key channels (the default) against every channel (@full), 32K x {1, 4}: dense,
#             oasis-previous-captured@full, oasis-previous-captured (device KV bytes, TPOT means over 48 steps)
#   llama     the Llama-3.1-8B shape, 32K x 1 and 8K x 8: dense, offload, oasis-previous eager and captured (means over
#             32 steps)
#   capturedride  the ride-along's cost on captured steps (issue 4's <= 5% of TPOT), 32K x {1, 4}: dense,
#             oasis-previous-captured, oasis-eagle3-captured; means over 48 steps
#   kernel    the Triton decode attention against SDPA (`@sdpa`), `previous` and the eagle3 ride-along captured,
#             32K x 1 (with dense) and x 4; 48 steps, interleaved
#   chain     chained drafts' cost (the LM head scores the draft row too): oasis-previous-captured,
#             oasis-eagle3-captured@headonly and oasis-eagle3-captured, 32K x {1, 4}; 48 steps, interleaved
#   lookaheads  TPOT and exposed wait of none, previous and eagle3 (captured, defaults) beside dense, 32K x {1, 4};
#             48 steps interleaved, then 4 measured steps (CUDA events: the wait on transfers) per oasis method
#   gatherprograms  the captured `previous` step with the package's gather programs (32 per K/V on the side stream of
#             an H200) against one per block (@gatherall, the default before the fourteenth session), 16 and 64,
#             32K x {1, 4} and 128K x 1; 32 steps interleaved + 4 measured (exposed wait)
#   prefill  bench/prefill.py: dense's prefill (whole, and in the cache's chunks) against oasis's chunked one with the
#             past kept on the device between chunks (resident_prefill) and read back from host memory at each chunk,
#             32K x PREFILL_BATCHES (1 4); then each under torch.profiler (top PREFILL_PROFILE=25 ops, *.profile.txt);
#             PREFILL_GENERATE=1: through model.generate (max_new_tokens=1) instead of the forward
#   gathershapes  bench/beside_gather.py: the side stream's gather shapes (programs x warps x blocks at once) by what
#             they cost a layer's matmuls beside them; then compiled 32K x 1 steps with a few of them (GATHER_METHODS)
#   attnkernel  bench/attention_kernel.py: the decode attention kernel alone against SDPA, by key ranges (splits)
#   eagle3exact  the default mode with a head (eagle3 + exact: joint scoring) against previous + exact, 32K x {1, 4}
# Decode benchmarks interleave their methods step by step (bench/decode.py --interleave), except `capped`.
# Logs and JSON under $OUT (at most 8 files come back).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HEAD=${HEAD:-oasis_cache/draft/heads/smollm2-135m-instruct}  # the shipped head; `train` switches to the new one
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for arg in "$@"; do
  case "$arg" in
    tests) python3 -c "import xdist" 2>/dev/null && X="-n 2" || X=""  # (two processes on the card: 251 s against 521 in one, H200, 2026-12-05)
      python3 -m pytest -q $X -m gpu tests/test_cuda.py tests/test_kernels.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25 ;;
    testsdiag) for run in plain again omp16 gccheck; do  # the twenty-ninth session's pending "invalid argument": up to
        # four runs of the CUDA tests, stopping at the first with a failure (conftest's `_no_cuda_error_left` names
        # the test that leaves a pending CUDA error); ~2-2.5 min each: start it with bench/gpu_bg.sh
        case $run in omp16) extra=OMP_NUM_THREADS=16 ;; gccheck) extra=OASIS_TEST_GC_CHECK=1 ;; *) extra= ;; esac
        env $extra python3 -m pytest -q -m gpu tests/test_cuda.py tests/test_kernels.py -p no:cacheprovider > "$OUT/pytest-gpu-diag-$run.log" 2>&1
        rc=$?; echo "$run: $(tail -n 1 "$OUT/pytest-gpu-diag-$run.log")"
        [ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR)|pending" "$OUT/pytest-gpu-diag-$run.log" | head -20; break; }
      done ;;
    testseager) OASIS_TEST_CUDA_GRAPH=0 python3 -m pytest -q -m gpu tests/test_cuda.py tests/test_kernels.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu-eager.log" | tail -25 ;;
    bench) python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 4 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --out "$OUT/decode-qwen3-8b-32k.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-32k.log" | tail -14 ;;
    compiled) python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 4 --steps 12 --warmup 3 --measure-steps 0 --methods dense dense-compiled offload --out "$OUT/decode-qwen3-8b-32k-compiled.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-compiled.log" | tail -8 ;;
    bench128k) python3 bench/decode.py --interleave --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 10 --warmup 2 --measure-steps 4 --prefill-chunk 32768 --out "$OUT/decode-qwen3-8b-128k.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-128k.log" | tail -8 ;;
    gptoss) python3 bench/decode.py --interleave --model gpt-oss-20b --contexts ${GPTOSS_CONTEXT:-32768} --batches 1 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --prefill-chunk 1024 --methods dense oasis-previous oasis-previous-captured --out "$OUT/decode-gpt-oss-20b.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-gptoss.log" | tail -6 ;;  # learned sinks: dense is HF's eager attention (gpt-oss has no SDPA path)
    mla) python3 bench/decode.py --interleave --model deepseek-v2-lite --contexts ${MLA_CONTEXT:-32768} --batches 1 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --prefill-chunk 4096 --methods dense oasis-previous oasis-previous-captured --out "$OUT/decode-deepseek-v2-lite.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-mla.log" | tail -6 ;;  # latent attention (a prefill expanded, steps absorbed), eager and captured, beside HF's SDPA over the expanded heads
    gemma2) python3 bench/decode.py --interleave --model gemma-2-2b --contexts 8192 --batches 1 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --prefill-chunk 2048 --methods dense oasis-previous oasis-previous-captured --out "$OUT/decode-gemma-2-2b.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-gemma2.log" | tail -6 ;;  # soft-capping on explicit scores, eager and captured; dense is HF's eager (no SDPA path)
    gptosscompiled) python3 bench/decode.py --interleave --model gpt-oss-20b --contexts ${GPTOSS_CONTEXT:-32768} --batches 1 --steps 12 --warmup 3 --measure-steps 0 --prefill-chunk 1024 --methods dense dense-compiled --out "$OUT/decode-gpt-oss-20b-compiled.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-gptoss-compiled.log" | tail -6 ;;  # the fair dense baseline for gptoss: StaticCache + torch.compile (eager attention: gpt-oss has no SDPA path), a process of its own
    profilegptoss) python3 bench/profile_step.py --model gpt-oss-20b --context 32768 --batch 1 --steps 6 --warmup 20 --prefill-chunk 1024 --host-profile --rows 25 --methods dense oasis-previous --out "$OUT" 2>&1 | grep --line-buffered -v Warning | grep -A 8 "==" ;;  # where a gpt-oss step's time goes beside dense eager
    capped) python3 bench/decode.py --model qwen3-8b --contexts 65536 --batches 1 --budget 2048 --steps 8 --warmup 2 --measure-steps 0 --prefill-chunk 8192 --memory-cap-gib 24 --methods dense oasis-previous --out "$OUT/decode-qwen3-8b-capped24.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-capped.log" | tail -5 ;;
    cappedauto) python3 bench/decode.py --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 12 --warmup 2 --measure-steps 0 --memory-cap-gib 24 --methods oasis-previous-captured@compiledsoon --out "$OUT/decode-qwen3-8b-128k-capped24-compiledsoon.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-cappedauto.log" | tail -4 ;;  # capped128k through the default's compilation (at the 4th step here)
    prefillpeak) python3 bench/prefill_peak.py --model qwen3-8b --context 32768 --batch ${PEAK_BATCH:-8} --cap-gib 24 --variants ${PEAK_VARIANTS:-default no-retry masked dry-after no-warm} ${PEAK_HISTORY:+--history} --out "$OUT/prefill-peak-32k-b${PEAK_BATCH:-8}-cap24.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/prefill-peak.log" ;;  # issue 21: which part of the prefill runs a capped 32K x 8 out of memory (forty-sixth session)
    capped128k) python3 bench/decode.py --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 8 --warmup 2 --measure-steps 0 --memory-cap-gib 24 --methods oasis-previous-captured --out "$OUT/decode-qwen3-8b-128k-capped24-defaults.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-capped128k.log" | tail -4 ;;
    capacity32k) python3 bench/capacity.py --model ${BENCH_MODEL:-qwen3-8b} --prompt ${PROMPT:-random} --contexts 32768 --caps ${CAPS:-24 0} --methods ${METHODS:-dense dense-chunked dense-compiled offload oasis} --batches ${BATCHES:-1 2 4 8 16} --new-tokens 24 --try-timeout 120 --out "$OUT/capacity-${BENCH_MODEL:-qwen3-8b}-32k${CAPS:+-cap${CAPS// /-}}${TAG:-}.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/capacity-32k${CAPS:+-cap${CAPS// /-}}${TAG:-}.log" ;;
    capacity128k) python3 bench/capacity.py --model qwen3-8b --contexts 131072 --caps ${CAPS:-24 0} --methods ${METHODS:-dense dense-chunked dense-compiled offload oasis} --batches ${BATCHES:-1 2 4} --new-tokens 24 --try-timeout 150 --out "$OUT/capacity-qwen3-8b-128k${CAPS:+-cap${CAPS// /-}}${TAG:-}.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/capacity-128k${CAPS:+-cap${CAPS// /-}}${TAG:-}.log" ;;
    firstcall) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 2 --fresh-kernel-cache --out "$OUT/first-call-qwen3-8b-32k.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call.log" ;;
    firstcallcold) du -sh ~/.nv/ComputeCache 2>&1 | sed "s/^/ComputeCache before: /" | tee -a "$OUT/first-call-cold.log"; for v in ${COLD_MODES:-oasis:jit oasis:nojit dense:nojit dense:jit}; do m=${v%%:*}; j=${v##*:}; ( [ $j = nojit ] && export CUDA_CACHE_DISABLE=1; python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 2 --processes 2 --fresh-kernel-cache $([ $m = dense ] && echo --dense) --out "$OUT/first-call-qwen3-8b-32k-cold-$m-$j.json" 2>&1 | grep --line-buffered -v Warning | grep -v "^     \|slowest" | sed "s/^/$v: /" | tee -a "$OUT/first-call-cold.log" ); du -sh ~/.nv/ComputeCache 2>&1 | sed "s/^/ComputeCache after $v: /" | tee -a "$OUT/first-call-cold.log"; done ;;  # issue 21 item 4 on a new machine: its first process paid 3.86x (forty-sixth session); what the driver's JIT cache (~/.nv/ComputeCache; CUDA_CACHE_DISABLE=1 turns it off, so each process pays as a new machine's first) holds of that, oasis and dense
    firstcallsplitwarm) for v in ${SPLITWARM_MODES:-0 1024 0 1024}; do python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 1 --fresh-kernel-cache --split-warm-queries $v --out "$OUT/first-call-qwen3-8b-32k-splitwarm-$v-$RANDOM.json" 2>&1 | grep --line-buffered -v Warning | grep -v "^     \|slowest\|router\|pinned:" | sed "s/^/warm $v: /" | tee -a "$OUT/first-call-splitwarm.log"; done ;;  # issue 21 item 4: the first chunk's warm-up of the later chunks' cuDNN kernels in a thread (compute/dense.warm_split_past; 0: none), alternating, each process with new kernel and driver JIT caches (a new machine's first process but for its disk)
    firstcallunaligned) python3 bench/first_call.py --model qwen3-8b --context ${CONTEXT:-32000} --new-tokens 32 --calls 3 --processes 1 --fresh-kernel-cache --out "$OUT/first-call-qwen3-8b-${CONTEXT:-32000}.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-unaligned.log" ;;  # a prompt whose blocks are not a power of two (the summaries' growth at the first completed block changed the top-k's specialization until the forty-third session)
    firstcallahead) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 2 --fresh-kernel-cache --compile-ahead --out "$OUT/first-call-qwen3-8b-32k-compile-ahead.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-ahead.log" ;;  # issue 21 item 4: compile_ahead (a dry first decode step compiles its kernels in parallel)
    firstcallpinning) for v in off default off default; do [ $v = off ] && export PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:False || unset PYTORCH_CUDA_ALLOC_CONF; python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 1 --fresh-kernel-cache --out "$OUT/first-call-qwen3-8b-32k-pinning-$v-$RANDOM.json" 2>&1 | grep --line-buffered -v Warning | grep -v "^     " | sed "s/^/$v: /" | tee -a "$OUT/first-call-pinning.log"; done; unset PYTORCH_CUDA_ALLOC_CONF ;;  # issue 21: OasisConfig.fast_pinning (default: torch pins by malloc + 8 threads + cudaHostRegister) against cudaHostAlloc (the user's setting pinned_use_cuda_host_register:False, which the package leaves alone), alternating, each a new kernel cache (forty-first session, with the env variable by hand: first token 3.0-3.2 -> 2.0-2.7 s)
    firstcallprefill) for v in decode prefill decode prefill; do python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 1 --fresh-kernel-cache $([ $v = prefill ] && echo --ahead-at-prefill || echo --no-ahead-at-prefill) --out "$OUT/first-call-qwen3-8b-32k-ahead-$v-$RANDOM.json" 2>&1 | grep --line-buffered -v Warning | grep -v "^     " | sed "s/^/$v: /" | tee -a "$OUT/first-call-ahead-prefill.log"; done ;;  # issue 21: ahead_at_prefill (the dry step's compilations during the prefill) against the default (before decode step 1), alternating, each a new kernel cache
    firstcallworkers) for v in ${WORKER_MODES:-threads processes threads processes}; do python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes ${WORKER_PROCESSES:-1} --fresh-kernel-cache --compile-workers $([ $v = threads ] && echo 0 || echo auto) $([ $v = prefill ] && echo --ahead-at-prefill) --out "$OUT/first-call-qwen3-8b-32k-workers-$v-$RANDOM.json" 2>&1 | grep --line-buffered -v Warning | grep -v "^     " | sed "s/^/$v: /" | tee -a "$OUT/first-call-workers.log"; done ;;  # issue 21: the dry step's compilations in worker processes (compile_workers=None, research) against threads (0, the default), alternating, each a new kernel cache; "prefill": processes with ahead_at_prefill (forty-second session: no gain, docs/perf.md)
    firstcallwarm) for v in ${WARM_MODES:-key key,driver,ptxas key key,driver,ptxas}; do python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 1 --fresh-kernel-cache --warm-parts "$v" --out "$OUT/first-call-qwen3-8b-32k-warm-${v//,/-}-$RANDOM.json" 2>&1 | grep --line-buffered -v Warning | grep -v "^     \|slowest" | sed "s/^/$v: /" | tee -a "$OUT/first-call-warm.log"; done ;;  # issue 21: the parts of Triton's start-up paid by the first prefill's thread (compute/ahead.WARM_PARTS), alternating, each a new process and kernel cache (forty-fourth session: the driver part seemed to lengthen the first token)
    firstcallregions) for v in ${REGION_MODES:-regions torch regions torch}; do python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 1 --fresh-kernel-cache $([ $v = regions ] && echo --pinned-regions) --out "$OUT/first-call-qwen3-8b-32k-pinning-$v-$RANDOM.json" 2>&1 | grep --line-buffered -v Warning | grep -v "^     \|slowest" | sed "s/^/$v: /" | tee -a "$OUT/first-call-regions.log"; done ;;  # issue 21, first call: the prefill's host chunks in one region the package maps and registers (pinned_regions, research) against torch's allocator (fast_pinning, the default), alternating, each a new process and kernel cache
    firstcallprofile) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 1 --profile "$OUT/later-call.prof" --profile-call 2 --out "$OUT/first-call-qwen3-8b-32k-profile.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-profile.log" ;;  # issue 21: cProfile of a later call (call 2): where its first token's 2.1 s (dense 0.8) and its steps 1-3, 16 go
    firstcalldense) for v in dense oasis; do python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 1 --fresh-kernel-cache $([ $v = dense ] && echo --dense) --out "$OUT/first-call-qwen3-8b-32k-$v-$RANDOM.json" 2>&1 | grep --line-buffered -v Warning | grep -v "^     \|slowest" | sed "s/^/$v: /" | tee -a "$OUT/first-call-dense.log"; done ;;  # issue 21: the dense baseline's first call against its later ones (DynamicCache: a process's first CUDA work, which oasis pays too), then oasis's, each a new process and kernel cache
    firstcallwarmed) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 2 --fresh-kernel-cache --warm-first --out "$OUT/first-call-qwen3-8b-32k-warmed.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-warmed.log" ;;  # issue 21 item 4: `python -m oasis_cache.warm` (the model's config, two layers) in a new kernel cache, then a process's first generate against its later ones
    firstcallnoahead) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 2 --fresh-kernel-cache --no-compile-ahead --out "$OUT/first-call-qwen3-8b-32k-no-compile-ahead.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-noahead.log" ;;  # issue 21: the first call without the dry step
    pinned) python3 bench/pinned_alloc.py --out "$OUT/pinned-alloc.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/pinned-alloc.log" ;;  # issue 21, first call: pinning the host pools (2.0 s of a first prefill at 32K x 1), alone, threaded, registered, beside device work
    pinnedhuge) python3 bench/pinned_alloc.py --cases ${PINNED_CASES:-runtime tunable mmap hugepages hugeone runtime tunable mmap hugepages hugeone} --out "$OUT/pinned-huge.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/pinned-huge.log" ;;  # issue 21, first call: the pools' 5 GiB at 32K pinned in ~1.4 s of the first prefill (forty-fourth session); whether memory the package maps itself with transparent huge pages registers faster than torch's malloc + register (fast_pinning, "runtime")
    fusedmemory) python3 bench/fused_memory.py --layers 8 --history 2>&1 | grep --line-buffered -v Warning | tee "$OUT/fused-memory.log" ;;  # issue 21: fuse_projections' device memory (fortieth session: +16.8 GiB from copies, fixed)
    firstcallcompiled) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 2 --fresh-kernel-cache --compile-decode --out "$OUT/first-call-qwen3-8b-32k-compile-decode.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-compiled.log" ;;  # issue 21 item 4 with compile_decode
    firstcallauto) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 512 --calls 6 --processes 1 --out "$OUT/first-call-qwen3-8b-32k-auto.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-auto.log" ;;  # issue 21: the default compile_decode=None compiles after 2048 steps (call 5 of 511 steps each)
    firstcallfused) python3 bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32 --calls 3 --processes 2 --fresh-kernel-cache --compile-decode --fuse-projections --out "$OUT/first-call-qwen3-8b-32k-compile-decode-fused.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/first-call-fused.log" ;;  # issue 21 item 4: compile_decode + fuse_projections, with compile phases and the Triton kernels compiled
    disagg) python3 bench/disagg.py --device cuda --context 32768 --budget 2048 --steps 32 --layers 4 --segment 4GB --out "$OUT/disagg-qwen3-8b-kv-32k.json" 2>&1 | grep --line-buffered -v "^[IWE]1\|Warning" | tee "$OUT/disagg.log" | tail -3
      python3 bench/disagg.py --device cuda --context 32768 --budget 2048 --steps 32 --layers 4 --segment 4GB --measure --out "$OUT/disagg-qwen3-8b-kv-32k-measure.json" 2>&1 | grep --line-buffered -v "^[IWE]1\|Warning" | tee "$OUT/disagg-measure.log" | tail -4 ;;
    disaggqwen) for d in ${DISAGG_MODES:-auto overlap off}; do python3 bench/disagg.py --model qwen25-coder-0.5b --device cuda --dtype bfloat16 --context 32768 --budget 2048 --steps 128 --segment 4GB --deferred ${d/overlap/on} $([ $d = overlap ] && echo --overlap) ${DISAGG_SETS:+--local-cache-sets $DISAGG_SETS} --out "$OUT/disagg-qwen05-32k-$d.json" 2>&1 | grep --line-buffered -v "^[IWE]1\|Warning\|Loading" | tee "$OUT/disagg-qwen05-$d.log" | tail -4; done ;;
    gather) python3 bench/gather.py 2>&1 | tee "$OUT/gather.log" ;;
    programs) python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 4 --budget 2048 --steps 10 --warmup 2 --measure-steps 4 --methods dense oasis-previous --gather-programs 64 --out "$OUT/decode-qwen3-8b-32k-b4-programs64.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-programs.log" | tail -4 ;;
    qwenindecode) python3 eval/in_decode.py --model qwen25-coder-0.5b --prompts "${INDECODE_PROMPTS:-8}" --new-tokens "${INDECODE_TOKENS:-4096}" --fractions ${INDECODE_FRACTIONS:-8 16} --modes ${INDECODE_MODES:-none previous} --out "$OUT/in-decode-qwen05.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/in-decode-qwen05.log" | tail -8 ;;
    qwenindecodepar) N=${INDECODE_TOKENS:-4096}; D=$OUT/in-decode-dense-$N.pt; files=()  # dense once (kept in $D, which comes back: carry it and set INDECODE_DENSE to skip it next time), then one process per (mode, budget)
      [ -n "${INDECODE_DENSE:-}" ] && cp "$INDECODE_DENSE" "$D"
      common="--model qwen25-coder-0.5b --prompts ${INDECODE_PROMPTS:-8} --new-tokens $N --dense $D ${REPORT_HEAD:+--head $HEAD}"
      python3 eval/in_decode.py $common --modes --out "$OUT/in-decode-qwen05-$N-dense.json" 2>&1 | grep --line-buffered -v Warning | tail -3
      [ -n "${INDECODE_DENSE_ONLY:-}" ] && continue
      for mode in ${INDECODE_MODES:-none previous}; do for f in ${INDECODE_FRACTIONS:-8 16}; do
        python3 eval/in_decode.py $common --modes $mode --fractions $f --out "$OUT/in-decode-qwen05-$N-$mode-$f.json" > "$OUT/in-decode-qwen05-$N-$mode-$f.log" 2>&1 &
        files+=("$OUT/in-decode-qwen05-$N-$mode-$f.json"); done; done; wait
      python3 eval/in_decode.py --merge "${files[@]}" --out "$OUT/in-decode-qwen05-$N.json" | tee "$OUT/in-decode-qwen05-$N.log" ;;
    qwenindecodeprompts) N=${INDECODE_TOKENS:-4096}; files=()  # one process per prompt, each its own unpadded batch (captured steps): dense, then every (mode, budget)
      for i in $(seq 0 $(( ${INDECODE_PROMPTS:-8} - 1 ))); do
        python3 eval/in_decode.py --model qwen25-coder-0.5b --prompts ${INDECODE_PROMPTS:-8} --only $i --per-prompt --new-tokens $N --modes ${INDECODE_MODES:-none previous} --fractions ${INDECODE_FRACTIONS:-8 16} ${REPORT_HEAD:+--head $HEAD} --out "$OUT/in-decode-qwen05-$N-p$i.json" > "$OUT/in-decode-qwen05-$N-p$i.log" 2>&1 &
        files+=("$OUT/in-decode-qwen05-$N-p$i.json"); done; wait
      python3 eval/in_decode.py --merge "${files[@]}" --out "$OUT/in-decode-qwen05-$N.json" | tee "$OUT/in-decode-qwen05-$N.log" ;;
    qwenreport) python3 eval/report.py --model qwen25-coder-0.5b --dtype "${REPORT_DTYPE:-bfloat16}" --tasks ${REPORT_TASKS:-single_needle multikey multivalue variable_tracking frequent_words} --filler noise --lengths ${REPORT_LENGTHS:-8192 16384 32768} --samples "${REPORT_SAMPLES:-24}" --batch-size 8 --fractions ${REPORT_FRACTIONS:-16 32} --modes ${REPORT_MODES:-none previous} ${REPORT_HEAD:+--head "$HEAD"} --nll-prefill 7936 --nll-tokens "${REPORT_NLL_TOKENS:-256}" --out "$OUT/report-qwen05${REPORT_TAG:-}.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/report-qwen05${REPORT_TAG:-}.log" | tail -40 ;;
    qwenreportpar) nll=${REPORT_NLL_TOKENS:-256}; for L in ${REPORT_LENGTHS:-8192 16384 32768}; do  # one process per length (the NLL rows in the first)
        HEAD=$HEAD REPORT_LENGTHS=$L REPORT_NLL_TOKENS=$nll REPORT_TAG=-$L${REPORT_TAG:-} bash "$0" qwenreport > /dev/null 2>&1 & nll=0; done; wait
      tail -n 45 "$OUT"/report-qwen05-*${REPORT_TAG:-}.log ;;
    suite) python3 eval/suite.py --out "$OUT/suite" ${SUITE_ARGS:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/suite.log" | tail -80 ;;  # issue 22's whole quality suite, both models (OASIS_SMOLLM2_GGUF and OASIS_QWEN05_GGUF set)
    qwenreporttasks) nll=${REPORT_NLL_TOKENS:-256}; L=${REPORT_LENGTHS:-32768}; for T in ${REPORT_TASKS:-single_needle multikey multivalue variable_tracking frequent_words}; do  # one process per task at one length (the NLL rows in the first)
        HEAD=$HEAD REPORT_LENGTHS=$L REPORT_TASKS=$T REPORT_NLL_TOKENS=$nll REPORT_TAG=-$L-$T${REPORT_TAG:-} bash "$0" qwenreport > /dev/null 2>&1 & nll=0
        while (( $(jobs -rp | wc -l) >= ${REPORT_PARALLEL:-3} )); do wait -n; done; done; wait  # at most 3 at once
      tail -n 12 "$OUT"/report-qwen05-$L-*${REPORT_TAG:-}.log ;;
    qwenrecall) for context in ${RECALL_CONTEXTS:-8000 16000}; do for k in ${RECALL_KS:-sixteenth}; do  # K: 1/16 of the context, or K blocks (issue 22's target: K = 20)
        if [ "$k" = sixteenth ]; then budget=$(( (context / 16 + 15) / 16 * 16 )); tag=; else budget=$(( (k + 1) * 16 )); tag=-k$k; fi
        python3 eval/recall.py --model qwen25-coder-0.5b ${REPORT_HEAD:+--head "$HEAD" --oracle} ${RECALL_TEXT:+--text "$RECALL_TEXT"} ${RECALL_LOOKUP:+--draft-lookup $RECALL_LOOKUP} --context $context --budget $budget ${RECALL_SLOTS:+--slots $RECALL_SLOTS} --steps ${RECALL_STEPS:-64} --sequences 1 --out "$OUT/recall-qwen05-$context$tag${RECALL_TAG:-}.json" 2>&1 | grep --line-buffered -v Warning | tail -5; done; done ;;
    qwenhead) HO=${HEAD_OUT:-/tmp/oasis-head}  # a Qwen head trained on documentation and code, then recall beside the shipped one ($QWEN_HEAD)
      TARGET=qwen25-coder-0.5b TRAIN_DTYPE=bfloat16 TRAIN_INTERMEDIATE=2048 TRAIN_SOURCE=${TRAIN_SOURCE:-mixed+code} bash "$0" train
      NEW_HEAD=$HO bash "$0" qwenheadsrecall ;;
    qwenheadsrecall)  # recall of $NEW_HEAD beside the shipped one ($QWEN_HEAD): 16K docs and 32K code, 4 jobs at once
      for h in "new:$NEW_HEAD" "shipped:${QWEN_HEAD:-oasis_cache/draft/heads/qwen2.5-coder-0.5b-instruct}"; do for t in docs:16000 code:32000; do
        HEAD=${h#*:} REPORT_HEAD=1 RECALL_LOOKUP=${RECALL_LOOKUP:-0 2 2+arbiter} RECALL_KS=${RECALL_KS:-sixteenth 20} RECALL_TEXT=${t%%:*} RECALL_CONTEXTS=${t#*:} RECALL_TAG=-${h%%:*}-${t%%:*} bash "$0" qwenrecall > "$OUT/recall-${h%%:*}-${t%%:*}.log" 2>&1 & done; done; wait
      tail -n 5 "$OUT"/recall-*.log ;;
    profile) python3 bench/profile_step.py --model qwen3-8b --context 32768 --batch 1 --steps 8 --methods dense oasis-previous-captured --out "$OUT" 2>&1 | grep --line-buffered -v Warning | grep -A 22 "==" ;;
    train) TD=${TRAIN_DIR:-/tmp/oasis-train} HO=${HEAD_OUT:-/tmp/oasis-head}
      python3 -m oasis_cache.draft.train --target "${TARGET:-smollm2}" --out "$TD" --documents 400 --document-tokens 4096 --generate-batch 64 --cache-features --steps "${TRAIN_STEPS:-20000}" --save-every 1000 --draft-vocab 8192 --time-limit "${TRAIN_SECONDS:-480}" ${TRAIN_INTERMEDIATE:+--intermediate-size "$TRAIN_INTERMEDIATE"} ${TRAIN_DTYPE:+--dtype "$TRAIN_DTYPE"} ${TRAIN_RESUME:+--resume} ${TRAIN_INIT:+--init-head "$HEAD"} ${TRAIN_DATA:+--data $TRAIN_DATA} ${TRAIN_SOURCE:+--document-source "$TRAIN_SOURCE"} ${TRAIN_CROP:+--crop "$TRAIN_CROP"} ${TRAIN_TTT:+--ttt "$TRAIN_TTT"} ${TRAIN_WEIGHT:+--confidence-weight "$TRAIN_WEIGHT"} ${TRAIN_LAYERS:+--layers "$TRAIN_LAYERS"} ${TRAIN_SCHEDULE:+--lr-schedule "$TRAIN_SCHEDULE"} ${TRAIN_LR:+--lr "$TRAIN_LR"} ${TRAIN_SEED:+--seed "$TRAIN_SEED"} --quiet 2>&1 | grep --line-buffered -v Warning | tee "$OUT/train.log" | tail -8
      python3 -c "
import torch, sys; from oasis_cache.draft import load_eagle3, save_eagle3
save_eagle3(load_eagle3('$TD/head').to(torch.bfloat16), '$HO')"
      mkdir -p "$OUT/head" && cp "$TD/head/target.json" "$HO/" && cp "$TD/metrics.json" "$OUT/head/" && split -b 15000000 "$HO/model.safetensors" "$OUT/head/part"
      { [ -z "${TRAIN_INIT:-}" ] || [ -n "${TRAIN_LAYERS:-}" ]; } && cp "$HO/config.json" "$OUT/head/"  # else $HEAD's
      [ -z "${TRAIN_INIT:-}" ] && cp "$HO/target.json" "$OUT/head/"  # from $HEAD: its target
      [ -z "${TRAIN_DATA:-}" ] && cp "$TD/data.pt" "$OUT/head/"; HEAD=$HO ;;
    gendata) python3 -m oasis_cache.draft.train --target "${TARGET:-smollm2}" --out "${GEN_DIR:-/tmp/oasis-gen}" --no-chats --documents "${GEN_DOCUMENTS:-400}" --document-tokens 4096 --document-source "${GEN_SOURCE:-mixed}" --seed "${GEN_SEED:-1}" ${GEN_PLAIN:+--continue-documents} ${GEN_GREEDY:+--greedy} --generate-batch 64 --steps 0 ${TRAIN_DTYPE:+--dtype "$TRAIN_DTYPE"} --quiet 2>&1 | grep --line-buffered -v Warning | tee "$OUT/gendata.log" | tail -3
      cp "${GEN_DIR:-/tmp/oasis-gen}/data.pt" "$OUT/gen-data.pt" ;;
    recall) for budget in ${RECALL_BUDGETS:-336 512}; do for prompt in document chat; do python3 eval/recall.py --head "$HEAD" --oracle --prompt $prompt --context 4000 --budget $budget --steps 64 --sequences "${RECALL_SEQUENCES:-4}" ${RECALL_LOOKUP:+--draft-lookup "$RECALL_LOOKUP"} --out "$OUT/recall-$prompt-$budget.json" 2>&1 | grep --line-buffered -v Warning | tail -5; done; done ;;
    report) python3 eval/report.py --tasks single_needle multi_needle passkey multikey multivalue variable_tracking frequent_words --lengths 4096 --samples 32 --batch-size 16 --fractions 8 --modes none none@bound previous eagle3 --head "$HEAD" --out "$OUT/report-smollm2-4k.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/report-4k.log" | tail -45 ;;
    report8k) python3 eval/report.py --tasks single_needle multi_needle passkey multikey --lengths 8192 --samples 32 --batch-size 16 --fractions 8 16 --modes none none@bound eagle3 --head "$HEAD" --nll-prefill 7936 --nll-tokens 256 --out "$OUT/report-smollm2-8k.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/report-8k.log" | tail -40 ;;
    noise) python3 eval/report.py --tasks single_needle multikey --filler noise --lengths 4096 --samples 48 --batch-size 16 --fractions 8 --modes none previous eagle3 none@bound --head "$HEAD" --nll-prefill 7936 --nll-tokens 256 --out "$OUT/report-smollm2-noise.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/report-noise.log" | tail -20 ;;
    full) python3 eval/report.py --tasks single_needle multi_needle passkey multikey multivalue variable_tracking --filler noise --lengths 4096 --samples 48 --batch-size 48 --fractions 8 --modes none previous eagle3 none@bound --head "$HEAD" --nll-prefill 7936 --nll-tokens 256 --out "$OUT/report-smollm2-full.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/report-full.log" | tail -40 ;;
    halfquality) python3 eval/report.py --tasks single_needle multi_needle passkey multikey multivalue variable_tracking --filler noise --lengths 4096 --samples 48 --batch-size 48 --fractions 8 --modes none@full none --nll-prefill 7936 --nll-tokens 256 --out "$OUT/report-smollm2-half.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/report-half.log" | tail -30 ;;
    budgets) python3 eval/report.py --tasks single_needle multikey --filler noise --lengths 4096 --samples 48 --batch-size 48 --fractions 4 8 16 --modes none previous eagle3 --head "$HEAD" --nll-prefill 7936 --nll-tokens 256 --out "$OUT/report-smollm2-budgets.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/report-budgets.log" | tail -30 ;;
    looptopk) for v in hybrid unrolled hybrid unrolled; do if [ $v = unrolled ]; then sed -i 's/^    return segments > 1$/    return True/' oasis_cache/kernels/top_k.py; else sed -i 's/^    return True$/    return segments > 1/' oasis_cache/kernels/top_k.py; fi; python3 bench/select_kernels.py --rows 2176 8704 --slots 128 2>&1 | grep --line-buffered -v Warning | grep select | sed "s/^/$v: /" | tee -a "$OUT/top-k-loop.log"; done; sed -i 's/^    return True$/    return segments > 1/' oasis_cache/kernels/top_k.py ;;  # issue 21: the top-k's rounds a loop at one stage, unrolled at two (`top_k.unrolled`, forty-third session) against unrolled everywhere, alternating
    compiletimes) python3 bench/compile_times.py --kernels top_k slot_assign block_scores attention --widths 2176 8704 --together --repeats 2 2>&1 | grep --line-buffered -v Warning | tee "$OUT/compile-times.log" ;;  # issue 21: each kernel's compilation on this host's CPU, then all one after another and all at once in threads
    loopscores) for v in unrolled loop unrolled loop; do if [ $v = loop ]; then sed -i 's/for bit in tl.static_range(8):/for bit in range(8):/' oasis_cache/kernels/block_scores.py; else sed -i 's/for bit in range(8):/for bit in tl.static_range(8):/' oasis_cache/kernels/block_scores.py; fi; for nb in 2176 8704; do python3 bench/score_kernel.py --batch 1 --blocks $nb --group 8 --kept-channels 64 --calls 36 --scorers bits --per-program 32 64 --warps 4 8 2>&1 | grep --line-buffered -v Warning | sed "s/^/$v: /" | tee -a "$OUT/score-loop.log"; done; done; sed -i 's/for bit in range(8):/for bit in tl.static_range(8):/' oasis_cache/kernels/block_scores.py ;;  # issue 21: the block scores' bit positions as a loop (compiles 0.42 -> 0.21 s on the CPU) against unrolled (the package's), alternating (forty-third session: the loop 4-5x slower, 35-41 against 8.6 us at 2,176 blocks: stays unrolled)
    scorekernel) for nb in 2176 8704; do python3 bench/score_kernel.py --batch 1 --blocks $nb --group 8 --kept-channels 64 --calls 36 --scorers bits --per-program 32 64 128 --warps 4 8; done 2>&1 | grep --line-buffered -v Warning | tee "$OUT/score-kernel.log" ;;  # a captured 32K / 128K x 1 step's block scores (4 heads x 2 tokens a KV head, half the channels)
    scoring) python3 eval/scoring.py --tasks single_needle multikey --length 4096 --samples 48 --fraction 8 --batch-size 16 --scorers bits bits_fp8 bound max --out "$OUT/scoring-smollm2.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/scoring.log" | tail -14 ;;
    scorers) python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 4 --budget 2048 --steps 12 --warmup 2 --measure-steps 0 --methods dense oasis-none oasis-none@bound oasis-previous oasis-previous@bound --out "$OUT/decode-qwen3-8b-32k-scorers.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-scorers.log" | tail -14 ;;
    profilecompiled) python3 bench/profile_step.py --model qwen3-8b --context 32768 --batch 1 --steps 8 --methods oasis-previous-captured oasis-previous-captured@compiled --out "$OUT" 2>&1 | grep --line-buffered -v Warning | grep -A 6 "==" ;;  # issue 21: what compile_decode leaves of a replayed step, by kernel group
    gatherprograms) for c in 32768 131072; do python3 bench/decode.py --interleave --model qwen3-8b --contexts $c --batches 1 --budget 2048 --steps 32 --warmup 8 --measure-steps 0 --prefill-chunk 16384 --methods oasis-previous-captured@compiled oasis-previous-captured@compiled+gather16 oasis-previous-captured@compiled+gather64 --out "$OUT/decode-qwen3-8b-$c-gather-programs.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-gather-programs-$c.log" | tail -6; done ;;  # issue 21: the side stream's gather programs (32 by default) once the steps are compiled
    compiledfused) for b in 1 4; do python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches $b --budget 2048 --steps 32 --warmup 8 --measure-steps 0 --methods oasis-previous-captured@compiled oasis-previous-captured@compiledfused --out "$OUT/decode-qwen3-8b-32k-b$b-fused.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-fused-b$b.log" | tail -4; done ;;  # issue 21: fused projections
    recompiles) python3 bench/recompiles.py 2>&1 | grep -v DEBUG | tail -40 | tee "$OUT/recompiles.log" ;;
    matmul) for m in 1 4; do python3 bench/matmul.py --rows $m 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/matmul.log"; done ;;  # issue 21: the matmuls' floor
    selectkernels) python3 bench/select_kernels.py 2>&1 | grep --line-buffered -v Warning | tee "$OUT/top-k.log" ;;  # issue 21: the select's rounds
    selectsegments) python3 bench/select_kernels.py --rows 2176 4352 8704 17408 --segments 1 2 4 8 16 0 --slots 128 2>&1 | grep --line-buffered -v Warning | tee "$OUT/top-k-segments.log" ;;  # issue 21: the two-stage select (thirty-seventh session) against one stage; then run profile128k
    launchkeys) TRITON_CACHE_DIR=$(mktemp -d) python3 bench/launch_keys.py --model qwen3-8b --prompt 32768 --new-tokens 40 --budget 2048 2>&1 | grep --line-buffered -v Warning | tee "$OUT/launch-keys.log" | tail -20 ;;  # issue 21, first call: which kernel specializations each forward meets on a fresh kernel cache, each first launch timed (decode step 16 took 2.4 s on a fresh machine)
    besidegather) { python3 bench/select_kernels.py --rows 2176 4352 8704 --segments 1 2 4 8 16 0 --slots 128 --beside-gather 8x16x4; for nb in 2176 8704; do python3 bench/score_kernel.py --batch 1 --blocks $nb --group 8 --kept-channels 64 --calls 36 --scorers bits --per-program 16 32 64 --warps 2 4 --beside-gather 8x16x4; done; python3 bench/matmul.py --rows 1 --grouped --beside-gather 8x16x4; } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/beside-gather.log" | grep -v "^   grouped" ;;  # issue 21: the select, the block scores and the matmuls timed beside the gather, as inside a step (kernels were 1.1-2x slower there than alone, thirty-eighth session; the package's gather shape since the thirty-ninth)
    gathershapes) python3 bench/beside_gather.py --shapes ${GATHER_SHAPES:-32x4x1 32x4x2 16x4x2 16x8x2 16x8x4 8x8x4 8x16x4 8x16x8 4x16x8} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/gather-shapes.log"
      for c in ${GATHER_CONTEXTS:-32768}; do python3 bench/decode.py --interleave --model qwen3-8b --contexts $c --batches 1 --budget 2048 --steps 32 --warmup 8 --measure-steps 4 --prefill-chunk 16384 --methods oasis-previous-captured@compiled ${GATHER_METHODS:-oasis-previous-captured@compiled+gather16x8x2 oasis-previous-captured@compiled+gather8x16x4 oasis-previous-captured@compiled+gather16x4x2} --out "$OUT/decode-qwen3-8b-$c-gather-shapes.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-gather-shapes-$c.log" | tail -8; done ;;  # issue 21: gather shapes by what they cost the matmuls beside them, then in compiled steps
    grouped) for m in 1 4; do python3 bench/matmul.py --rows $m --grouped 2>&1 | tee "$OUT/matmul-grouped-m$m.log" | grep -v "^   grouped"; done ;;  # issue 21: q/k/v and gate/up in one launch with the weights in place (kernels/grouped_linear.py) against cuBLAS alone and fused
    profile128k) python3 bench/profile_step.py --model qwen3-8b --context 131072 --batch 1 --steps 8 --methods oasis-previous-captured@compiled oasis-previous-captured@compiled+gather64 --out "$OUT" 2>&1 | grep --line-buffered -v Warning | grep -A 7 "==" ;;  # issue 21: where a compiled 128K step's time goes (the select kernel saved ~1.1 ms of device time, the step 0.1 ms)
    profiletopk) for n in 32768 49152; do python3 bench/profile_step.py --model qwen3-8b --context $n --batch 1 --steps 8 --methods oasis-previous-captured@compiledtorchtopk oasis-previous-captured@compiled --out "$OUT" 2>&1 | grep --line-buffered -v Warning | grep -A 6 "=="; done ;;  # issue 21: the selection's top-k
    profile3) python3 bench/profile_step.py --model qwen3-8b --context 32768 --batch 1 --steps 8 --methods oasis-previous oasis-eagle3 --out "$OUT" 2>&1 | grep --line-buffered -v Warning | grep --line-buffered "==" ;;
    eagle3) python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 4 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --methods dense oasis-previous oasis-eagle3-plain oasis-eagle3 --out "$OUT/decode-qwen3-8b-32k-eagle3.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-eagle3.log" | tail -10 ;;
    eagle3exact) python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 4 --budget 2048 --steps 12 --warmup 2 --measure-steps 4 --methods dense oasis-exact oasis-eagle3-exact --out "$OUT/decode-qwen3-8b-32k-eagle3-exact.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-eagle3-exact.log" | tail -8 ;;
    captured) for spec in "1:dense offload oasis-previous oasis-previous-captured oasis-exact-captured" "4:dense offload oasis-previous oasis-previous-captured"; do [[ " ${CAPTURED_BATCHES:-1 4} " == *" ${spec%%:*} "* ]] || continue; python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches "${spec%%:*}" --budget 2048 --steps 48 --warmup 4 --measure-steps 0 --statistic mean --methods ${spec#*:} --out "$OUT/decode-qwen3-8b-32k-b${spec%%:*}-captured.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-captured-b${spec%%:*}.log" | tail -7; done ;;
    resultstable) bash "$0" captured  # README "Results" (~540 s on the H200): the rows above, 128K's dense and oasis, dense compiled, the compiled steady state
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 24 --warmup 4 --measure-steps 0 --statistic mean --prefill-chunk 32768 --methods dense oasis-previous-captured --out "$OUT/decode-qwen3-8b-128k-captured.json" 2>&1 | grep --line-buffered -v Warning | tail -3
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 4 --steps 12 --warmup 3 --measure-steps 0 --methods dense dense-compiled --out "$OUT/decode-qwen3-8b-32k-compiled.json" 2>&1 | grep --line-buffered -v Warning | tail -5
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 --budget 2048 --steps 32 --warmup 8 --measure-steps 0 --methods oasis-previous-captured oasis-previous-captured@compiled --out "$OUT/decode-qwen3-8b-32k-b1-compiled.json" 2>&1 | grep --line-buffered -v Warning | tail -3
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 24 --warmup 8 --measure-steps 0 --prefill-chunk 32768 --methods oasis-previous-captured@compiled --out "$OUT/decode-qwen3-8b-128k-b1-compiled.json" 2>&1 | grep --line-buffered -v Warning | tail -2 ;;
    budgetbound) for budget in 2048 1024 512; do  # issue 21's 32K x 4: step time against the bytes fetched (the host link's bound)
        python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 4 --budget $budget --steps 32 --warmup 8 --measure-steps 4 --methods oasis-previous-captured --out "$OUT/decode-qwen3-8b-32k-b4-budget$budget.json" 2>&1 | grep -v Warning | tail -1 | sed "s/^/32K x 4, budget $budget: /"; done
      for budget in 2048 1024 2048 1024; do  # 32K x 1 compiled steps, alternating budgets in sibling processes
        python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches 1 --budget $budget --steps 32 --warmup 8 --measure-steps 0 --methods oasis-previous-captured@compiled --out "$OUT/decode-qwen3-8b-32k-b1-compiled-budget$budget-$SECONDS.json" 2>&1 | grep -v Warning | tail -1 | sed "s/^/32K x 1 compiled, budget $budget: /"; done ;;
    captured128k) python3 bench/decode.py --interleave --model qwen3-8b --contexts 131072 --batches 1 --budget 2048 --steps 48 --warmup 4 --measure-steps 0 --statistic mean --prefill-chunk 32768 --methods dense oasis-previous oasis-previous-captured --out "$OUT/decode-qwen3-8b-128k-captured.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-captured128k.log" | tail -8
      python3 bench/decode.py --interleave --model qwen3-8b --contexts 131072 --batches 1 --steps 16 --warmup 2 --measure-steps 0 --statistic mean --prefill-chunk 32768 --methods dense offload --out "$OUT/decode-qwen3-8b-128k-offload.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-offload128k.log" | tail -4 ;;
    capturedeagle3) for b in 1 4; do python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches $b --budget 2048 --steps 48 --warmup 4 --measure-steps 0 --statistic mean --methods dense oasis-previous-captured oasis-eagle3-exact oasis-eagle3-exact-captured --out "$OUT/decode-qwen3-8b-32k-b$b-captured-eagle3.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-captured-eagle3-b$b.log" | tail -6; done ;;
    compileddecode) for b in 1 4; do python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches $b --budget 2048 --steps 48 --warmup 8 --measure-steps 0 --statistic mean --methods dense oasis-previous-captured oasis-previous-captured@compiled oasis-eagle3-exact-captured oasis-eagle3-exact-captured@compiled --out "$OUT/decode-qwen3-8b-32k-b$b-compiled.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-compiled-b$b.log" | tail -6; done ;;
    capturedride) for b in 1 4; do python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches $b --budget 2048 --steps 48 --warmup 4 --measure-steps 0 --statistic mean --methods dense oasis-previous-captured oasis-eagle3-captured --out "$OUT/decode-qwen3-8b-32k-b$b-captured-ride.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-captured-ride-b$b.log" | tail -5; done ;;
    chain) for b in 1 4; do python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches $b --budget 2048 --steps 48 --warmup 4 --measure-steps 0 --statistic mean --methods oasis-previous-captured oasis-eagle3-captured@headonly oasis-eagle3-captured --out "$OUT/decode-qwen3-8b-32k-b$b-chain.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-chain-b$b.log" | tail -5; done ;;
    lookaheads) for b in 1 4; do python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches $b --budget 2048 --steps 48 --warmup 4 --measure-steps 4 --statistic mean --methods dense oasis-none-captured oasis-previous-captured oasis-eagle3-captured --out "$OUT/decode-qwen3-8b-32k-b$b-lookaheads.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-lookaheads-b$b.log" | tail -6; done ;;
    prefill) for b in ${PREFILL_BATCHES:-1 4}; do python3 bench/prefill.py --model qwen3-8b --device cuda --context 32768 --batch $b --repeats 3 --profile "${PREFILL_PROFILE:-25}" ${PREFILL_GENERATE:+--generate} --out "$OUT/prefill-qwen3-8b-32k-b$b${PREFILL_GENERATE:+-generate}.json" 2>&1 | grep --line-buffered -v Warning | tail -5; done ;;
    chunkattention) python3 bench/chunk_attention.py --out "$OUT/chunk-attention.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/chunk-attention.log" ;;  # a prompt chunk's attention over its past: SDPA's lower-right mask (flash) against cuDNN's past and chunk merged (compute/dense.SPLIT_PAST)
    attnkernel) python3 bench/attention_kernel.py 2>&1 | grep --line-buffered -v Warning | tee "$OUT/attention-kernel.log" ;;
    kernel) for spec in "1:dense oasis-previous-captured@sdpa oasis-previous-captured oasis-eagle3-captured@sdpa oasis-eagle3-captured" "4:oasis-previous-captured@sdpa oasis-previous-captured oasis-eagle3-captured"; do b=${spec%%:*}
        python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches $b --budget 2048 --steps 48 --warmup 4 --measure-steps 0 --statistic mean --methods ${spec#*:} --out "$OUT/decode-qwen3-8b-32k-b$b-kernel.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-kernel-b$b.log" | tail -6; done ;;
    half) for b in 1 4; do python3 bench/decode.py --interleave --model qwen3-8b --contexts 32768 --batches $b --budget 2048 --steps 48 --warmup 4 --measure-steps 0 --statistic mean --methods dense oasis-previous-captured@full oasis-previous-captured --out "$OUT/decode-qwen3-8b-32k-b$b-half.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-half-b$b.log" | tail -5; done ;;
    llama) for spec in 32768:1 8192:8; do python3 bench/decode.py --interleave --model llama-3.1-8b --contexts "${spec%%:*}" --batches "${spec#*:}" --budget 2048 --steps 32 --warmup 4 --measure-steps 0 --statistic mean --methods dense offload oasis-previous oasis-previous-captured --out "$OUT/decode-llama-3.1-8b-${spec%%:*}-b${spec#*:}-captured.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/decode-llama-${spec%%:*}-b${spec#*:}.log" | tail -6; done ;;
    exact32k) python3 bench/exactness.py --model qwen3-8b --context 32768 --dtype float32 --new-tokens 12 2>&1 | grep --line-buffered -v Warning | tee "$OUT/exactness-qwen3-8b-32k.log" ;;
  esac
done
