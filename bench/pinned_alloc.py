"""What pinning a host pool costs a process's first prefill, and whether it can overlap the device's work (issue 21,
first call: a profile of the first `generate` at 32K x 1 on Qwen3-8B shapes showed 2.0-2.1 s in `torch.empty(...,
pin_memory=True)` for the host pools' 324 chunks of 16 MiB; a later call of the process reuses torch's cached
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
    if case == "runtime":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from oasis_cache.memory.host_memory import use_fast_pinning

        result["fast_pinning"] = use_fast_pinning()
        start = time.perf_counter()
    if case in ("alloc", "register", "runtime"):
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
    else:
        raise ValueError(case)
    torch.cuda.synchronize()
    result["seconds"] = time.perf_counter() - start
    result["pinned_gib"] = len(kept) * nbytes / 2**30
    return result


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
        print(f"{case:9s} {row['seconds']:7.3f} s  pinned {row['pinned_gib']:.2f} GiB"
              f"  ({row['matmuls_per_layer']} matmuls of {row['matmul_ms']:.3f} ms a layer){extra}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
