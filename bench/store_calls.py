"""What one batched Mooncake Store call costs, and how large a batch may be (the remote tier's publish and fetch).

    python bench/store_calls.py                      # put / get per object, by object size, batches of 1024
    python bench/store_calls.py --probe 2049 3000    # one batch of each count (a failing one waits 60 s)
    python bench/store_calls.py --ranges             # large objects, read back by byte ranges

Starts a store on this host (`oasis_cache.remote.local_store`, 1 GB), puts `--total` bytes as objects of each size
by `batch_put_from` calls of `BATCH_OBJECTS` objects, gets them back by `batch_get_into`, and prints the time per
object and the throughput (medians of `--repeats`). `--probe N ...`: one `batch_put_from` of N 8-KiB objects each,
on a fresh store, and whether every object went in (Mooncake 0.3.13 fails whole batches above ~2K objects).
`--ranges`: the other layout a remote tier could use — 32 objects of 256 units of 8 KiB (a head's blocks of one
host chunk in one object), put whole, then `get_into_ranges` of 4 / 16 / 64 units from each into a registered buffer,
and the same reads by `batch_get_into_multi_buffer_ranges` inside a get session (`batch_get_session_start`: the
replicas looked up once; without a session that call answers -600).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache.remote import connect, local_store  # noqa: E402
from oasis_cache.remote.mooncake import BATCH_OBJECTS, in_batches  # noqa: E402


def timed_calls(call, keys, addresses, size) -> tuple[float, bool]:
    start = time.perf_counter()
    status = in_batches(call, keys, addresses, [size] * len(keys))
    return time.perf_counter() - start, all(s in (0, size) for s in status)


def per_object(total: int, sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    with local_store("1GB") as master:
        client = connect(master).client
        data = torch.randint(0, 255, (total,), dtype=torch.uint8)
        back = torch.zeros_like(data)
        for size in sizes:
            n = total // size
            puts, gets = [], []
            for rep in range(repeats):
                keys = [f"bench/{size}/{rep}/{i}" for i in range(n)]
                put, ok_put = timed_calls(client.batch_put_from, keys, [data.data_ptr() + i * size for i in range(n)],
                                          size)
                get, ok_get = timed_calls(client.batch_get_into, keys, [back.data_ptr() + i * size for i in range(n)],
                                          size)
                assert ok_put and ok_get and torch.equal(back[: n * size], data[: n * size])
                client.remove_by_regex(f"^bench/{size}/{rep}/", True)
                puts.append(put)
                gets.append(get)
            put, get = statistics.median(puts), statistics.median(gets)
            rows.append(dict(object_bytes=size, objects=n, put_us_per_object=put / n * 1e6,
                             get_us_per_object=get / n * 1e6, put_gb_s=n * size / put / 1e9,
                             get_gb_s=n * size / get / 1e9))
            print(f"{size >> 10:5} KiB x {n:5}: put {rows[-1]['put_us_per_object']:6.1f} us/object "
                  f"({rows[-1]['put_gb_s']:.2f} GB/s), get {rows[-1]['get_us_per_object']:6.1f} us/object "
                  f"({rows[-1]['get_gb_s']:.2f} GB/s)", flush=True)
        client.close()
    return rows


def probe(count: int) -> dict:
    size = 8 << 10
    with local_store("1GB") as master:
        client = connect(master).client
        data = torch.zeros(count * size, dtype=torch.uint8)
        start = time.perf_counter()
        status = client.batch_put_from([f"probe/{i}" for i in range(count)],
                                       [data.data_ptr() + i * size for i in range(count)], [size] * count)
        seconds = time.perf_counter() - start
        client.close()
    failed = [s for s in status if s != 0]
    print(f"one batch of {count} objects: {seconds:.2f} s, {len(failed)} failed {sorted(set(failed))}", flush=True)
    return dict(objects=count, seconds=seconds, failed=len(failed), codes=sorted(set(failed)))


def ranges(repeats: int) -> list[dict]:
    unit, per, count = 8 << 10, 256, 32
    rows = []
    with local_store("1GB") as master:
        client = connect(master).client
        data = torch.randint(0, 255, (count * per * unit,), dtype=torch.uint8)
        back = torch.zeros_like(data)
        assert client.register_buffer(back.data_ptr(), back.numel()) == 0
        keys = [f"ranges/{i}" for i in range(count)]
        puts = []
        for rep in range(repeats):
            start = time.perf_counter()
            status = client.batch_put_from([f"{k}/{rep}" for k in keys],
                                           [data.data_ptr() + i * per * unit for i in range(count)], [per * unit] * count)
            puts.append(time.perf_counter() - start)
            assert all(s == 0 for s in status)
        put = statistics.median(puts)
        print(f"put {count} objects of {per} units: {put / (count * per) * 1e6:.1f} us per unit "
              f"({count * per * unit / put / 1e9:.2f} GB/s)", flush=True)
        generator = torch.Generator().manual_seed(0)
        for want in (4, 16, 64):
            gets = []
            for rep in range(repeats):
                picks = [torch.randperm(per, generator=generator)[:want].sort().values.tolist() for _ in range(count)]
                start = time.perf_counter()
                got = client.get_into_ranges([back.data_ptr()], [[f"{k}/{rep}" for k in keys]],
                                             [[[(i * per + u) * unit for u in p] for i, p in enumerate(picks)]],
                                             [[[u * unit for u in p] for p in picks]], [[[unit] * want] * count])
                gets.append(time.perf_counter() - start)
                assert all(n == unit for per_buffer in got for per_key in per_buffer for n in per_key)
                assert all(torch.equal(back[(i * per + u) * unit: (i * per + u + 1) * unit],
                                       data[(i * per + u) * unit: (i * per + u + 1) * unit])
                           for i, p in enumerate(picks) for u in p)
            get = statistics.median(gets)
            sessions = []  # the same reads as one get session: replicas looked up once, then ranged reads
            for rep in range(repeats):
                names = [f"{k}/{rep}" for k in keys]
                picks = [torch.randperm(per, generator=generator)[:want].sort().values.tolist() for _ in range(count)]
                assert all(s == 0 for s in client.batch_get_session_start(names))
                start = time.perf_counter()
                got = client.batch_get_into_multi_buffer_ranges(
                    names, [[back.data_ptr() + (i * per + u) * unit for u in p] for i, p in enumerate(picks)],
                    [[unit] * want] * count, [[u * unit for u in p] for p in picks])
                sessions.append(time.perf_counter() - start)
                client.batch_get_session_end(names)
                assert got == [want * unit] * count
                assert all(torch.equal(back[(i * per + u) * unit: (i * per + u + 1) * unit],
                                       data[(i * per + u) * unit: (i * per + u + 1) * unit])
                           for i, p in enumerate(picks) for u in p)
            session = statistics.median(sessions)
            rows.append(dict(units_per_object=per, units_read_per_object=want, objects=count,
                             put_us_per_unit=put / (count * per) * 1e6, get_us_per_unit=get / (count * want) * 1e6,
                             session_get_us_per_unit=session / (count * want) * 1e6))
            print(f"{want} units from each object: get_into_ranges {rows[-1]['get_us_per_unit']:.1f} us per unit, "
                  f"in a get session {rows[-1]['session_get_us_per_unit']:.1f}", flush=True)
        client.close()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", type=int, default=16 << 20, help="bytes per size (default 16 MiB)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8 << 10, 32 << 10, 128 << 10])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe", type=int, nargs="*", default=[])
    parser.add_argument("--ranges", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = dict(command="python " + " ".join(sys.argv), batch_objects=BATCH_OBJECTS)
    if args.probe:
        out["probes"] = [probe(n) for n in args.probe]
    elif args.ranges:
        out["ranges"] = ranges(args.repeats)
    else:
        out["rows"] = per_object(args.total, args.sizes, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
