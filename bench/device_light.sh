#!/usr/bin/env bash
# The device tool carries the working tree with each call, 64 MiB in all; the shipped heads (~56 MB) leave almost
# nothing for model parts. `bash bench/device_light.sh on` takes them out of the index (the files stay, ignored
# through .git/info/exclude), so calls carry ~4 MB of tree and up to ~60 MB of parts; a call that needs a head
# carries it (carry ["oasis_cache/draft/heads/<name>"]). `bash bench/device_light.sh off` puts them back.
# Do not commit between `on` and `off`: the commit would delete the heads.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
heads=oasis_cache/draft/heads
exclude=.git/info/exclude
hook="$(git rev-parse --git-path hooks)/pre-commit"  # (while on, a commit is refused: it would delete the heads)
case "${1:-}" in
  on)  git rm -r -q --cached "$heads"
       grep -qx "/$heads/" "$exclude" 2>/dev/null || echo "/$heads/" >> "$exclude"
       mkdir -p "$(dirname "$hook")"
       printf '#!/bin/sh\n# device_light\necho "bench/device_light.sh is on: this commit would delete the shipped heads;' > "$hook"
       printf ' run: bash bench/device_light.sh off" >&2\nexit 1\n' >> "$hook"
       chmod +x "$hook"
       echo "heads out of the index; 'bash bench/device_light.sh off' before any commit" ;;
  off) sed -i "\#^/$heads/\$#d" "$exclude"
       git reset -q -- "$heads"
       grep -q "^# device_light" "$hook" 2>/dev/null && rm -f "$hook"
       git status --short -- "$heads" ;;
  *)   echo "usage: bash bench/device_light.sh on|off" >&2; exit 2 ;;
esac
