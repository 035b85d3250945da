"""How many sequences of a context one host holds in its host pools, for each `host_dtype`: the pools' own sizing
(`HostKVPool.bytes_to_reserve`, chunks as the pinned allocator rounds them, the blocks a layer reserves ahead) against
the host memory this process may allocate (`available_host_bytes`, less the headroom the cache keeps). Nothing is
allocated: the model's shape is read from its config alone. A batch's tokens per second at that size is measured by
`bench/capacity.py` (which runs it).

    python bench/host_capacity.py --model qwen3-8b --context 131072
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.models import SHAPES  # noqa: E402
from oasis_cache.layer import HOST_GROWTH_SPREAD  # noqa: E402
from oasis_cache.memory.host_memory import HEADROOM_BYTES, available_host_bytes  # noqa: E402
from oasis_cache.pools import HostKVPool  # noqa: E402

DTYPES = (None, "fp8", "int4")


def host_bytes(config, context: int, batch: int, host_dtype, dtype=torch.bfloat16, block_size: int = 16,
               chunk_blocks: int = 256) -> int:
    """Host bytes one cache's pools take for `batch` sequences of `context` tokens (every layer full attention)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = HostKVPool(batch, config.num_key_value_heads, head_dim, block_size, dtype, chunk_blocks, True, host_dtype)
    blocks = context // block_size + 1 + HOST_GROWTH_SPREAD  # (the most a layer reserves ahead)
    return config.num_hidden_layers * pool.bytes_to_reserve(blocks)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", choices=[name for name in SHAPES if name != "tiny"])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--host-gib", type=float, default=0, help="host memory to size for (0: what is available)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = SHAPES[args.model]()
    room = int(args.host_gib * 2**30) if args.host_gib else (available_host_bytes() or 0) - HEADROOM_BYTES
    rows = []
    for host_dtype in DTYPES:
        batch = 0
        while host_bytes(config, args.context, batch + 1, host_dtype) <= room:
            batch += 1
        one = host_bytes(config, args.context, 1, host_dtype)
        rows.append(dict(host_dtype=host_dtype or "bf16", sequences=batch, gib_per_sequence=one / 2**30,
                         bytes_per_token=one / args.context))
    base = rows[0]["sequences"] or 1
    print(f"{args.model}, {args.context} tokens a sequence, {room / 2**30:.1f} GiB of host memory to fill")
    for r in rows:
        r["vs_bf16"] = r["sequences"] / base
        print(f"  {r['host_dtype']:5} {r['gib_per_sequence']:7.2f} GiB a sequence  {r['sequences']:4d} sequences "
              f"({r['vs_bf16']:.2f}x bf16's)")
    total = next((int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:")), 0)
    meta = dict(command="python " + " ".join(sys.argv), machine=f"{platform.machine()} host, {total / 2**30:.0f} GiB",
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                host_gib=room / 2**30, model=args.model, context=args.context)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"host-capacity-{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
