#!/usr/bin/env bash
# One step of the device machine's setup per call (a call carries at most 64 MiB: the tree plus one model part).
# Both real models' GGUF files land in /tmp on the device, their paths and PYTHONPATH in /tmp/env.sh; the shipped
# heads are copied to /tmp/heads too. Parts are made here first: `bash ../shared/tools/qwen05-parts.sh split`
# (.model/q00..q08) and `bash bench/smollm2_parts3.sh` (.model/p1..p3). Calls back to back (a warm machine is given
# back after ~30 s idle), with `bash bench/device_light.sh on` here (the heads out of the tree):
#   carry [".model/q00"]: bash bench/gpu_setup.sh q00        ... the same for q01 ... q07
#   carry [".model/q08", "oasis_cache/draft/heads/qwen2.5-coder-0.5b-instruct"]: bash bench/gpu_setup.sh q08
#     (add ".model/qwen-head-data" to that carry to bring the Qwen head's training texts, 7 MB: /tmp/q/head-data.pt)
#   carry [".model/p1"]: bash bench/gpu_setup.sh p1          carry [".model/p2"]: bash bench/gpu_setup.sh p2
#   (a candidate Qwen head in .model/qwen-head-ft, ignored: carry [".model/qwen-head-ft"]: bash bench/gpu_setup.sh qwenft
#    -> /tmp/qwen-head-ft, for NEW_HEAD=/tmp/qwen-head-ft bash bench/gpu_run.sh qwenheadsrecall)
#   carry [".model/p3", "oasis_cache/draft/heads/smollm2-135m-instruct"]: bash bench/gpu_setup.sh p3 && <start a job>
# Start the main job in the last setup call: a machine can vanish between two calls, and with it the setup.
# A job then runs `. /tmp/env.sh` (and `bash bench/gpu_setup.sh heads` if the tree lacks the heads); every later
# call carries both heads while a job reads them (a call without them removes them from the device's tree).
set -euo pipefail
step=${1:?usage: bash bench/gpu_setup.sh q00..q08 | p1 | p2 | p3 | heads | qwenft}
heads=oasis_cache/draft/heads
case "$step" in
  q00) mkdir -p /tmp/q && cp .model/q00/* /tmp/q/
       echo "export OMP_NUM_THREADS=2 PYTHONPATH=/tmp/site:$PWD:$PWD/tests" > /tmp/env.sh ;;
  q0[1-7]) cp ".model/$step/"* /tmp/q/ ;;
  q08) cat /tmp/q/c0[0-7] .model/q08/c08 > /tmp/q/qwen.gguf
       [ "$(md5sum < /tmp/q/qwen.gguf | cut -d' ' -f1)" = fa36a8a7b86e1a0355ecc8545f26e885 ] || {
         echo "qwen.gguf: wrong md5 (a part missing? $(ls /tmp/q | xargs))" >&2; exit 1; }
       rm -f /tmp/q/c0*
       python3 -m pip install -q --no-index --no-deps --target /tmp/site .model/q08/gguf-*.whl
       echo "export OASIS_QWEN05_GGUF=/tmp/q/qwen.gguf" >> /tmp/env.sh
       mkdir -p /tmp/heads && cp -r "$heads/qwen2.5-coder-0.5b-instruct" /tmp/heads/
       # the shipped head's training texts, where carried (TRAIN_DATA=/tmp/q/head-data.pt: no texts to write)
       if [ -f .model/qwen-head-data/data.pt ]; then cp .model/qwen-head-data/data.pt /tmp/q/head-data.pt; fi ;;
  p1) mkdir -p /tmp/smol && cp .model/p1/* /tmp/smol/
      [ -f /tmp/env.sh ] || echo "export OMP_NUM_THREADS=2 PYTHONPATH=/tmp/site:$PWD:$PWD/tests" > /tmp/env.sh ;;
  p2) cp .model/p2/* /tmp/smol/ ;;
  p3) cat /tmp/smol/gpart00 /tmp/smol/gpart01 .model/p3/gpart02 > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
      rm -f /tmp/smol/gpart0*
      [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/smol/gguf-*.whl
      echo "export OASIS_SMOLLM2_GGUF=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf" >> /tmp/env.sh
      mkdir -p /tmp/heads && cp -r "$heads/smollm2-135m-instruct" /tmp/heads/ ;;
  heads) mkdir -p "$heads" && cp -r /tmp/heads/* "$heads/" ;;
  qwenft) mkdir -p /tmp/qwen-head-ft && cp .model/qwen-head-ft/* /tmp/qwen-head-ft/ ;;  # a candidate Qwen head (36 MB)
  *) echo "unknown step $step: q00..q08, p1, p2, p3, heads, qwenft" >&2; exit 2 ;;
esac
echo "$step done: $(ls /tmp/q /tmp/smol 2>/dev/null | xargs)"
