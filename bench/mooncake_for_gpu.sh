#!/usr/bin/env bash
# Mooncake Store for a device call. The GPU image has python 3.12 and no Mooncake; the non-CUDA build is enough (TCP on loopback, host memory).
# Writes `.mc/` (ignored): the cp312 wheel (46 MB; the CUDA build is 98 MB, over a call's 64 MiB) and the Debian
# packages of the system libraries it links (libibverbs, libnl, libnuma; ~0.3 MB). Run here once, with
# `bash bench/device_light.sh on` (the tree must stay small), then carry [".mc"] and begin the call with:
#   mkdir -p /tmp/mcroot && for f in .mc/*.deb; do dpkg -x $f /tmp/mcroot; done && export
#   LD_LIBRARY_PATH=/tmp/mcroot/usr/lib/x86_64-linux-gnu:/tmp/mcroot/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-} &&
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .mc/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   && export PATH=/tmp/site/bin:$PATH && ldd /tmp/site/mooncake/store*.so | grep "not found"
# (the last command lists any library still missing there: libcurl and its own needs are expected on the image).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .mc && mkdir -p .mc
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .mc mooncake-transfer-engine-non-cuda==0.3.13.post1
(cd .mc && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 2>/dev/null)
ls -l .mc
