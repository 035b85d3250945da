#!/usr/bin/env bash
# Work longer than one device call: a call returns within 10 minutes, but a job started in its own process session
# runs on while the machine stays warm (calls back to back, each within ~30 s of the last). Jobs live in /tmp/bg.
# A machine left 30 s without a call goes back with every job on it (lost so): keep a
# `wait` call in flight the whole time and read results between calls in seconds, or after the jobs end.
#   bash bench/gpu_bg.sh start NAME 'COMMAND'   runs COMMAND (bash, in this checkout) with OUT=/tmp/bg/NAME/out;
#                                                returns at once; /tmp/bg/NAME/rc holds its exit status when it ends
#   bash bench/gpu_bg.sh wait SECONDS [NAME...]  returns when the named jobs (default: all) have ended or after SECONDS
#   bash bench/gpu_bg.sh collect [NAME...]       each job's state and log tail; its files (logs, out/) as
#                                                $OUT/bg-NAME.tgz, cut in 15 MB pieces (a call returns 8 files)
# e.g. one call: `bash bench/gpu_bg.sh start train 'TRAIN_SECONDS=900 bash bench/gpu_run.sh train'`, later ones:
# `bash bench/gpu_bg.sh wait 500 train; bash bench/gpu_bg.sh collect train`. Keep each call's own wait shorter than
# its limit: what a killed call wrote under $OUT may not come back.
set -uo pipefail
BG=/tmp/bg
jobs_named() { if [ $# -gt 0 ]; then echo "$@"; else ls "$BG" 2>/dev/null; fi; }
state() { local d=$BG/$1; if [ -f "$d/rc" ]; then echo "$1: ended, rc $(cat "$d/rc"), $(( $(stat -c %Y "$d/rc") - $(cat "$d/started") )) s"; else echo "$1: running, $(( $(date +%s) - $(cat "$d/started") )) s"; fi; }
cmd=${1:-}; shift || true
case "$cmd" in
  start)
    name=$1; shift; d=$BG/$name
    [ -e "$d" ] && { echo "job $name exists: $(state "$name")" >&2; exit 2; }
    mkdir -p "$d/out" && date +%s > "$d/started" && printf '%s\n' "$*" > "$d/command"
    setsid nohup bash -c "cd '$PWD' && export OUT='$d/out' && ( $* ); echo \$? > '$d/rc'" > "$d/log" 2>&1 < /dev/null &
    echo "started $name" ;;
  wait)
    limit=$1; shift; names=$(jobs_named "$@"); until=$(( $(date +%s) + limit ))
    for n in $names; do [ -f "$BG/$n/started" ] || { echo "no job $n (jobs: $(ls "$BG" 2>/dev/null | xargs))" >&2; exit 2; }; done
    while [ "$(date +%s)" -lt "$until" ]; do
      left=0; for n in $names; do [ -f "$BG/$n/rc" ] || left=1; done
      [ $left = 0 ] && break; sleep 5
    done
    for n in $names; do state "$n"; done ;;
  collect)
    for n in $(jobs_named "$@"); do
      state "$n"; tail -n 6 "$BG/$n/log" | sed "s/^/  $n| /"
      tar czf - -C "$BG" "$n" | split -b 15000000 -d - "${OUT:-/tmp/out}/bg-$n.tgz."
    done ;;
  *) echo "usage: bash bench/gpu_bg.sh start NAME 'COMMAND' | wait SECONDS [NAME...] | collect [NAME...]" >&2; exit 2 ;;
esac
