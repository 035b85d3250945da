"""What pinning a host pool costs a process's first prefill, and whether it can overlap the device's work` for the host pools' 324 chunks of 16 MiB; a later call of the process reuses torch's cached
pinned blocks).

    python bench/pinned_alloc.py                       # CUDA: each case in a fresh child process
    python bench/pinned_alloc.py --chunks 324 --chunk-mib 16 --layers 36

Cases (each child a new process, so torch's caching host allocator starts empty):
  alloc      the chunks pinned one after another on the main thread (what the prefill does now), seconds
  threads4   the same chunks from 4 threads at once
  register   the same with PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8
             (malloc, pages touched by 8 threads, then cudaHostRegister)
  runtime    the same, the settings extended at run time by the package (`memory.host_memory.use_fast_pinning`,
             what a CUDA cache does before it pins its first chunk: `OasisConfig.fast_pinning`)
  sync       one chunk pinned while ~0.3 s of matmuls are queued: the call's seconds (≈ 0.3: it waits for the device)
  layered    a prefill's shape: per layer, matmuls queued (~--layer-ms of device time) then that layer's chunks pinned;
             wall to the end of the device work
  ahead      the same matmuls, the chunks pinned by a thread started first (the pool grown ahead of the prefill)
  device     the matmuls alone (the floor of `layered` and `ahead`)
  hugepages  the chunks mapped by the bench itself (anonymous mmap, 2 MiB-aligned, `MADV_HUGEPAGE`), touched by torch's
             threads (`zero_`), then `cudaHostRegister`ed: whether transparent huge pages make registration faster (: the first prefill at 32K still pins 5 GiB in ~1.4 s); reports the touch and
             register seconds apart, the AnonHugePages gained, and whether torch then sees the memory as pinned
  mmap       the same without `MADV_HUGEPAGE` (4 KiB pages: the control)
  hugeone    `hugepages` as one region for all the chunks, registered in one call
  tunable    `runtime` with glibc asked to back malloc's mappings with transparent huge pages
             (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, glibc >= 2.35, read at a process's start): torch's own pinning on
             huge pages, if the machine's glibc has the tunable
Every case also reports the AnonHugePages it gained (`anon_huge_gib`): whether its memory came as huge pages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time


def matmul_loop(n_matmuls: int, a, b):
    for _ in range(n_matmuls):
        a = a @ b
    return a


def child(case: str, chunks: int, chunk_mib: int, layers: int, layer_ms: float) -> dict:
    import torch

    torch.cuda.init()
    nbytes = chunk_mib << 20
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    matmul_loop(20, a, b)
    torch.cuda.synchronize()
    start = time.perf_counter()
    matmul_loop(200, a, b)
    torch.cuda.synchronize()
    per_matmul = (time.perf_counter() - start) / 200
    per_layer = max(1, round(layer_ms / 1000 / per_matmul))
    kept = []

    def pin(count):
        for _ in range(count):
            kept.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))

    result = {"case": case, "matmul_ms": per_matmul * 1000, "matmuls_per_layer": per_layer}
    start = time.perf_counter()
    huge_at_start = anon_huge_bytes()
    if case in ("runtime", "tunable"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from oasis_cache.memory.host_memory import use_fast_pinning

        result["fast_pinning"] = use_fast_pinning()
        start = time.perf_counter()
    if case in ("alloc", "register", "runtime", "tunable"):
        pin(chunks)
    elif case == "threads4":
        threads = [threading.Thread(target=pin, args=(chunks // 4,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif case == "sync":
        matmul_loop(round(0.3 / per_matmul), a, b)
        queued = time.perf_counter()
        pin(1)
        result["pin_call_s"] = time.perf_counter() - queued
    elif case == "layered":
        per = chunks // layers
        for _ in range(layers):
            matmul_loop(per_layer, a, b)
            pin(per)
    elif case == "ahead":
        thread = threading.Thread(target=pin, args=(chunks // layers * layers,))
        thread.start()
        for _ in range(layers):
            matmul_loop(per_layer, a, b)
        thread.join()
    elif case == "device":
        for _ in range(layers):
            matmul_loop(per_layer, a, b)
    elif case in ("hugepages", "mmap", "hugeone"):
        result.update(map_and_register(case, chunks, nbytes, kept))
    else:
        raise ValueError(case)
    torch.cuda.synchronize()
    result["seconds"] = time.perf_counter() - start
    result["pinned_gib"] = sum(t.numel() * t.element_size() for t in kept) / 2**30
    result.setdefault("anon_huge_gib", (anon_huge_bytes() - huge_at_start) / 2**30)
    return result


def anon_huge_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def map_and_register(case: str, chunks: int, nbytes: int, kept: list) -> dict:
    """Host memory mapped here and registered with CUDA (see the cases `hugepages`, `mmap`, `hugeone`)."""
    import mmap

    import torch

    huge, advise = 2 << 20, case != "mmap"
    sizes = [chunks * nbytes] if case == "hugeone" else [nbytes] * chunks
    touch_s = register_s = 0.0
    huge_before = anon_huge_bytes()
    errors = set()
    for size in sizes:
        region = mmap.mmap(-1, size + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if advise:
            region.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(region, dtype=torch.uint8)
        skip = (-whole.data_ptr()) % huge
        chunk = whole[skip: skip + size]
        start = time.perf_counter()
        chunk.zero_()  # (the pages touched: torch's threads)
        touch_s += time.perf_counter() - start
        start = time.perf_counter()
        error = torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), size, 0)
        register_s += time.perf_counter() - start
        errors.add(int(error))
        kept.append(chunk)
    probe = kept[-1][:1 << 20]
    device = probe.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return {"touch_s": touch_s, "register_s": register_s, "register_errors": sorted(errors),
            "anon_huge_gib": (anon_huge_bytes() - huge_before) / 2**30, "is_pinned": bool(probe.is_pinned()),
            "copied": bool(torch.equal(device.cpu(), probe))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=324)
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--layer-ms", type=float, default=70.0, help="device time per layer (a 32K prefill: ~70)")
    parser.add_argument("--cases", nargs="+", default=["alloc", "threads4", "register", "runtime", "sync", "device",
                                                        "layered", "ahead", "alloc", "layered", "ahead"])
    parser.add_argument("--out", default="")
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.chunks, args.chunk_mib, args.layers, args.layer_ms)))
        return
    rows = []
    for case in args.cases:
        env = dict(os.environ)
        if case == "register":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
        if case == "tunable":
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        command = [sys.executable, __file__, "--child", case, "--chunks", str(args.chunks), "--chunk-mib",
                   str(args.chunk_mib), "--layers", str(args.layers), "--layer-ms", str(args.layer_ms)]
        out = subprocess.run(command, env=env, capture_output=True, text=True)
        if out.returncode:
            print(case, "failed:", out.stderr[-2000:], flush=True)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        extra = f"  pin call {row['pin_call_s']:.3f} s" if "pin_call_s" in row else ""
        extra += f"  use_fast_pinning() -> {row['fast_pinning']}" if "fast_pinning" in row else ""
        extra += f"  AnonHugePages +{row['anon_huge_gib']:.2f} GiB" if "touch_s" not in row else ""
        extra += (f"  touch {row['touch_s']:.3f} s, register {row['register_s']:.3f} s (errors "
                  f"{row['register_errors']}), AnonHugePages +{row['anon_huge_gib']:.2f} GiB, is_pinned "
                  f"{row['is_pinned']}, copied {row['copied']}") if "touch_s" in row else ""
        print(f"{case:9s} {row['seconds']:7.3f} s  pinned {row['pinned_gib']:.2f} GiB"
              f"  ({row['matmuls_per_layer']} matmuls of {row['matmul_ms']:.3f} ms a layer){extra}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
