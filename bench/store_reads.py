"""Where a remote unit's read time goes: Mooncake Store reads on this host by the shape of the read, the same bytes
each way. A decode step of an admitted cache reads the units it misses, one store object each (`batch_get_into`);
this separates the cost of a key, of a transfer and of a byte, and whether reads spread over clients or storage
processes.

    python bench/store_reads.py --unit-kib 8 --units 256 --storage 1 2 --out bench/results/store-reads-cpu.json

Rows, each the median of `--repeats` reads of `--units` units in random order, in µs a unit:
    objects      one object per unit, one `batch_get_into` (what the remote tier reads)
    ranges       one object holding every unit, one range a unit (`batch_get_into_multi_buffer_ranges`)
    runs of R    that object read in ranges of R adjacent units (a layout that keeps a step's units adjacent)
    whole        that object read as one transfer (the per-byte floor)
    clients C    `objects` split over C clients of this process, called at once from C threads
for every count of storage processes in `--storage` (objects are placed over them by the master).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from oasis_cache.remote.mooncake import connect, local_store  # noqa: E402


def median_us(read, units: int, repeats: int) -> float:
    read()  # (a first read pays the connections)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / units


def rows_for(master: str, args) -> list[dict]:
    U, N = args.unit_kib << 10, args.units
    clients = [connect(master) for _ in range(max(args.clients))]
    raw = clients[0].client
    source = torch.randint(0, 255, (N, U), dtype=torch.uint8)
    keys = [f"bench/unit/{i}" for i in range(N)]
    assert all(r == 0 for r in raw.batch_put_from(keys, [source[i].data_ptr() for i in range(N)], [U] * N))
    assert raw.put_from("bench/all", source.data_ptr(), N * U) == 0
    assert raw.batch_get_session_start(["bench/all"]) == [0]  # (ranged reads need the object's replicas looked up)
    arena = torch.zeros((N, U), dtype=torch.uint8)
    order = torch.randperm(N).tolist()

    def objects(client, part):
        got = client.client.batch_get_into([keys[i] for i in part], [arena[i].data_ptr() for i in part],
                                           [U] * len(part))
        assert all(g == U for g in got), got[:4]

    def ranges(run):
        starts = sorted(order)[::run]
        got = raw.batch_get_into_multi_buffer_ranges(["bench/all"], [[arena[i].data_ptr() for i in starts]],
                                                     [[U * min(run, N - i) for i in starts]],
                                                     [[U * i for i in starts]])
        assert got[0] >= 0, got

    def clients_at_once(count):
        parts = [order[k::count] for k in range(count)]
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            list(pool.map(objects, clients[:count], parts))

    reads = {"objects": lambda: objects(clients[0], order), "ranges": lambda: ranges(1)}
    for run in args.runs:
        reads[f"runs of {run}"] = lambda run=run: ranges(run)
    reads["whole"] = lambda: ranges(N)
    for count in args.clients:
        if count > 1:
            reads[f"clients {count}"] = lambda count=count: clients_at_once(count)
    rows = []
    for name, read in reads.items():
        arena.zero_()
        us = median_us(read, N, args.repeats)
        assert torch.equal(arena, source), name  # (every row reads every unit to where it belongs)
        rows.append(dict(read=name, us_per_unit=round(us, 2)))
        print(f"  {name:14} {us:8.1f} µs a unit", flush=True)
    raw.batch_get_session_end(["bench/all"])
    raw.remove_by_regex("^bench/", True)
    for client in clients:
        client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unit-kib", type=int, default=8, help="a unit's size (Qwen3-8B, bf16: 2 x 16 x 128 x 2 B)")
    parser.add_argument("--units", type=int, default=256)
    parser.add_argument("--runs", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--storage", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = dict(command="python " + " ".join(sys.argv), host=platform.node(), cpus=os.cpu_count(),
                  date=datetime.date.today().isoformat(), args=vars(args), storage={})
    for storage in args.storage:
        print(f"{storage} storage process(es), {args.units} units of {args.unit_kib} KiB:", flush=True)
        with local_store(f"{max(256, 4 * args.units * args.unit_kib >> 10)}MB", storage=storage) as master:
            result["storage"][storage] = rows_for(master, args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
