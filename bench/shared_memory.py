"""Shared memory of the decode attention kernel's split program, compiled for a GPU without one: Triton compiles it
for `--arch` (sm_90: H100 / H200) on this machine's CPU (`triton.compile` with a `GPUTarget`), per head width, dtype
and keys per tile — which configurations a card's limit (232,448 bytes on sm_90) refuses (`kernels/fitting.py`).

    python bench/shared_memory.py                 # D in 128 256 512, bf16 and float32, 64 / 32 / 16 keys a tile
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from oasis_cache.kernels import decode_attention  # noqa: E402

POINTERS = ("query", "keys", "values", "out")  # the model's dtype; the others below


def shared_bytes(head_dim: int, tile: int, dtype: str, group: int, arch: int) -> int:
    kernel = decode_attention._split_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    const = dict(G=group, QN=1, ROWS=max(16, triton.next_power_of_2(group)), D_POW2=head_dim, BLOCK=tile,
                 IEEE=dtype == "fp32", RECENT_APART=True, FUSED=False, SPLITS_POW2=32, CHUNK=128, HAS_SINKS=False)
    other = dict(visible="*i8", recent_visible="*i8", count="*i64", part_acc="*fp32", part_stats="*fp32",
                 tickets="*i64", sinks="*fp32")
    signature = {}
    for name in names:
        if name in const:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*" + dtype
        elif name in other:
            signature[name] = other[name]
        else:
            signature[name] = "fp32" if name == "scale" else "i64" if name.startswith("stride") else "i32"
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32)).metadata.shared


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--tiles", type=int, nargs="+", default=[64, 32, 16])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--group", type=int, default=8, help="query heads per KV head")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}, G = {args.group}: shared memory in bytes")
    print(f"{'D':>5} {'dtype':>6} " + " ".join(f"{t:>9} keys" for t in args.tiles))
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            sizes = [shared_bytes(head_dim, tile, dtype, args.group, args.arch) for tile in args.tiles]
            print(f"{head_dim:>5} {dtype:>6} " + " ".join(f"{size:>14,}" for size in sizes))


if __name__ == "__main__":
    main()
