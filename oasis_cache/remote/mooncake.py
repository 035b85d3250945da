"""Complete blocks of a cache's host pools in a Mooncake Store.

One store object per (request, generation, layer, block, sequence, KV head): that head's keys and values of the
block, `[2, *U]` as the host pool holds it (`[2, T, D]`, or narrow bytes with `host_dtype`) — what a decode step that
selects the block for that head reads, so a decode side fetches only the heads it selects (`remote/local_cache.py`).
Published from a unit-major staging copy of each host-pool chunk
(`batch_put_from`) and got straight into the decode side's local cache (`batch_get_into`), both batched. Keys:
`oasis/{request}/{generation}/{layer}/{block}/{sequence}/{head}`, the generation a random name each publication
draws, so a request published again never reads the blocks of an earlier publication; the request's record
(`oasis/{request}/record`) names the generation its blocks are under. The bytes live in the store's storage
processes (`mooncake_client`, or any client that mounts a segment), not in the publishing process, which may exit
once it has published. Every store call is bounded by the client's `timeout` (`ConnectionError` past it).

    mooncake_master --rpc_port=50051 --rpc_address=127.0.0.1 &
    mooncake_client --master_server_address=127.0.0.1:50051 --metadata_server=P2PHANDSHAKE \
        --global_segment_size=4GB --host=127.0.0.1 --port=50052 &

    store = connect("127.0.0.1:50051")
    tier = RemoteTier(store, request="req-7", generation="g1")
    tier.publish(layer_idx, pool)              # every complete block of the pool
    tier.get_units(layer_idx, [(3, 0, 1)], [address], size)   # block 3 of sequence 0, KV head 1
    tier.delete()                              # every key of the request
    cleanup(store, "req-7")                    # the same, from any process (a decode process that died)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..pools.host_kv import HostKVPool

KEY_PREFIX = "oasis"
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: no segment has room
TRANSFER_FAILED = -800  # TRANSFER_FAIL (also a transfer that timed out)
# Objects per batched call. Mooncake 0.3.13's batch_put_from / batch_get_into fail a batch of more than ~2,048
# objects (3,000: 2,832 of them, after a 60 s timeout, status -800; 2,049: one or none; whatever their size: measured
# on loopback TCP, a micro-benchmark, docs/performance.md), so every batch here is cut into calls of at most this many.
BATCH_OBJECTS = 1024
# Memory a failed transfer may still write into or read from: Mooncake can leave a timed-out transfer's I/O in flight
# after the call returns, so the tensors behind its addresses are kept until the process exits (never freed).
_KEPT_AFTER_FAILED_TRANSFER: list[torch.Tensor] = []


def in_batches(call, keys: list, *per_key: list) -> list:
    """`call(keys, *per_key)` (a batched store call: one result per key) made in calls of at most `BATCH_OBJECTS`
    keys, each list cut alike; the results of all calls, in order."""
    return [result for lo in range(0, len(keys), BATCH_OBJECTS)
            for result in call(keys[lo: lo + BATCH_OBJECTS], *(values[lo: lo + BATCH_OBJECTS] for values in per_key))]


class RemoteBlocksMissing(RuntimeError):
    """Blocks a fetch asked for are not in the store (never published, deleted, or lost with a store restart)."""


DEFAULT_TIMEOUT = 5.0  # seconds a store call may take before the client gives up on the store (`StoreClient`)
DEFAULT_THREADS = 4  # batched reads and writes of units run as this many calls at once (`StoreClient.map_calls`)
MIN_SLICE_UNITS = 32  # a batched call is split across threads only into slices of at least this many units


def connect(master: str, *, hostname: str = "127.0.0.1", protocol: str = "tcp",
            metadata_server: str = "P2PHANDSHAKE", segment_bytes: int = 0, buffer_bytes: int = 64 << 20,
            timeout: float = DEFAULT_TIMEOUT, threads: int = DEFAULT_THREADS):
    """A `MooncakeDistributedStore` client of the master at `master` ("host:port").

    `segment_bytes`: storage this process lends the store (0, the default: none — the blocks live in the store's
    storage processes and outlive this one). `buffer_bytes`: the client's local transfer buffer (a value `put` or
    `get` whole must fit it: records are cut into parts of a quarter of it). `timeout`: seconds any one store call
    may take; past it the call raises `ConnectionError` and the client refuses further calls (a store that does not
    answer in time is taken as gone: `connect` again once it is back). `threads`: batched reads and writes of units
    are split into this many calls made at once (each unit costs the client ~20 us of its own CPU time)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}.")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:  # the wheel, or the system library it links (libibverbs)
        raise ImportError(
            f"The remote tier needs Mooncake Store: pip install 'oasis-cache[remote]' (the package "
            f"mooncake-transfer-engine-non-cuda on CPU hosts, mooncake-transfer-engine on CUDA hosts), and on Debian / "
            f"Ubuntu `apt-get install -y libibverbs1`, which its binaries link even over TCP ({error})."
        ) from error
    host, _, port = master.rpartition(":")
    start = (f"Start it with `mooncake_master --rpc_port={port}` and a storage process (`mooncake_client "
             f"--master_server_address={master} --metadata_server={metadata_server} --global_segment_size=4GB`).")
    try:  # the client's own setup waits minutes on a master that is not there
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as error:
        raise ConnectionError(f"No Mooncake master answers at {master!r} ({error}). {start}") from error
    client = MooncakeDistributedStore()
    status = client.setup(hostname, metadata_server, segment_bytes, buffer_bytes, protocol, "", master)
    if status != 0:
        raise ConnectionError(
            f"Could not join the Mooncake Store whose master is {master!r} (setup returned {status}). {start}")
    return StoreClient(client, timeout=timeout, buffer_bytes=buffer_bytes, threads=threads)


class StoreClient:
    """A `MooncakeDistributedStore` client that is safe to close while caches still use it (what `connect` returns).

    Mooncake's client crashes the process on most calls once it is closed, and an admitted cache calls it from a
    host thread too (its prefetches, `memory/streams.py`), which may still be fetching when `generate` has returned.
    Here every call and `close()` take one lock: `close` waits for a call in flight, and a call after it raises
    `ConnectionError` naming the fix instead of reaching the closed client. Every method of the client is here
    (`put`, `get`, `batch_get_into`, ...), with the same arguments and results; `client` is the wrapped one.

    Each call runs on a thread of the client's and is waited for at most `timeout` seconds (Mooncake's own waits on
    a store that stopped answering run for minutes): past it, `ConnectionError`, and every later call refuses at
    once (`failed`) — the stuck call may still end, and the memory it reads or writes is kept by the callers
    (`_KEPT_AFTER_FAILED_TRANSFER`). `buffer_bytes`: the client's transfer buffer, which one `put` or `get` must
    fit."""

    def __init__(self, client, timeout: float = DEFAULT_TIMEOUT, buffer_bytes: int = 64 << 20,
                 threads: int = DEFAULT_THREADS):
        self.client = client
        self.closed = False
        self.failed: str | None = None  # why the client refuses calls: one did not answer within `timeout`
        self.timeout = timeout
        self.buffer_bytes = buffer_bytes
        self._lock = threading.RLock()
        self._callers = [_Caller() for _ in range(threads)]
        self._caller = self._callers[0]

    def close(self) -> int:
        """Close the client (once), after the call in flight, if any; later calls raise `ConnectionError`. A client
        whose call timed out is left as it is (closing it under the stuck call could crash the process)."""
        if self.failed is not None:
            self.closed = True
            return 0
        with self._lock:
            if self.closed:
                return 0
            self.closed = True
            for caller in self._callers:
                caller.stop()
            return self.client.close()

    def health_check(self) -> int:
        """0 open, 1 closed, 2 cut off from its master (Mooncake's codes)."""
        if self.failed is not None:
            return 2
        with self._lock:
            return 1 if self.closed else self.client.health_check()

    @property
    def threads(self) -> int:
        return len(self._callers)

    def map_calls(self, name: str, calls: list[tuple]) -> list:
        """`[client.<name>(*args) for args in calls]`, the calls made at once on the client's threads (Mooncake's
        client takes concurrent calls), all within one `timeout`."""
        method = getattr(self.client, name)
        with self._lock:
            if self.closed or self.failed is not None:
                raise ConnectionError(self.failed or f"The Mooncake Store client is closed (store.close() was "
                                                     f"called); {name} needs an open one: connect() again.")
            futures = [self._callers[i % len(self._callers)].submit(method, *args) for i, args in enumerate(calls)]
            deadline = time.monotonic() + self.timeout
            try:
                return [future.result(timeout=max(0.0, deadline - time.monotonic())) for future in futures]
            except concurrent.futures.TimeoutError:
                self.failed = _timed_out(name, self.timeout)
                raise ConnectionError(self.failed) from None

    def __getattr__(self, name: str):
        method = getattr(self.client, name)
        if not callable(method):
            return method

        def bounded(*args, **kwargs):
            if self.failed is not None:
                raise ConnectionError(self.failed)
            with self._lock:
                if self.closed:
                    raise ConnectionError(f"The Mooncake Store client is closed (store.close() was called); {name} "
                                          f"needs an open one: connect() again, and publish the request again if "
                                          f"its blocks are gone.")
                if self.failed is not None:
                    raise ConnectionError(self.failed)
                call = self._caller.submit(method, *args, **kwargs)
                try:
                    return call.result(timeout=self.timeout)
                except concurrent.futures.TimeoutError:
                    self.failed = _timed_out(name, self.timeout)
                    raise ConnectionError(self.failed) from None

        return bounded


def _timed_out(name: str, timeout: float) -> str:
    return (f"The Mooncake Store did not answer a {name} call within {timeout:g} s (its master or storage process "
            f"stopped, or cannot be reached): this client refuses further calls. Start the store again, connect() "
            f"again (connect(..., timeout=) waits longer), and publish the request again if its blocks are gone.")


def in_slices(store, name: str, keys: list, *per_key: list) -> list:
    """`store.<name>(keys, *per_key)` (a batched call: one result per key), made in rounds of at most `BATCH_OBJECTS`
    keys (Mooncake fails batches with more objects in flight), each round's keys cut into calls made at once on the
    client's threads (`StoreClient.map_calls`): at most as many as it has threads, each of at least `MIN_SLICE_UNITS`
    keys. The results of all calls, in order."""
    threads = store.threads if isinstance(store, StoreClient) else 1
    results = []
    for start in range(0, len(keys), BATCH_OBJECTS):
        end = min(len(keys), start + BATCH_OBJECTS)
        slices = max(1, min(threads, (end - start) // MIN_SLICE_UNITS))
        size = -(-(end - start) // slices)
        calls = [(keys[lo : min(end, lo + size)], *(values[lo : min(end, lo + size)] for values in per_key))
                 for lo in range(start, end, size)]
        if len(calls) == 1:
            results.extend(getattr(store, name)(*calls[0]))
        else:
            results.extend(r for part in store.map_calls(name, calls) for r in part)
    return results


class _Caller:
    """One daemon thread that runs the calls it is given (a call stuck in the store never holds up the interpreter's
    exit, as a thread pool's worker would)."""

    def __init__(self):
        import queue

        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="oasis-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, method, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(method(*args, **kwargs))
                except BaseException as error:  # noqa: BLE001 - (handed to the caller)
                    future.set_exception(error)

    def submit(self, method, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, method, args, kwargs))
        return future

    def stop(self) -> None:
        self._queue.put(None)


class RemoteTier:
    """One request's blocks in a Mooncake Store.

    Args:
        store: a client of the store: `connect`'s, or a `MooncakeDistributedStore` set up by the caller (its calls
            from this tier then go through a `StoreClient` of the tier's own).
        request: the request's name, unique among live requests in the store (letters, digits, `-`, `_`, `.`).
        generation: the publication its blocks belong to (a name of the same letters; `publish` draws one).
    """

    def __init__(self, store, request: str, generation: str = "0"):
        if not isinstance(request, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", request):
            raise ValueError(f"request must be a non-empty name of letters, digits, '-', '_' or '.', got {request!r}.")
        if not isinstance(store, StoreClient) and not all(hasattr(store, name) for name in
                                                          ("batch_put_from", "batch_get_into", "remove_by_regex")):
            raise TypeError(f"store must be a Mooncake Store client: oasis_cache.remote.connect('host:port') (or a "
                            f"MooncakeDistributedStore you set up), got {type(store).__name__}.")
        if not isinstance(generation, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", generation):
            raise ValueError(f"generation must be a name of letters, digits, '-', '_' or '.', got {generation!r}.")
        self.store = store if isinstance(store, StoreClient) else StoreClient(store)
        self.request = request
        self.generation = generation
        self.bytes_put = 0
        self.bytes_got = 0
        self.repair_seconds, self.repairs = 0.0, 0  # host time in `repair_after_step` (deferred prefetches), calls
        self.local_group = None  # the decode side's `LocalCacheGroup`, where its layers' local caches share a shape
        self.overlap = False  # its store reads run while the step runs (`remote.repair.start_repair`)
        self.repair_exposed_seconds = 0.0  # with `overlap`: what the next forward waited for them and finished
        self.copies = None  # with `overlap` on CUDA: the stream its host thread copies the step's records on
        # its seconds by phase: the records' copy back (the wait for the step's end included), plan, store reads,
        # maps and gathers
        self.repair_phases = torch.zeros(4, dtype=torch.float64)

    def key(self, layer_idx, block, sequence=None, head=None) -> str:
        """A unit's key (`sequence`, `head` given) or one of this generation's own (`key("record", part)`)."""
        tail = "" if sequence is None else f"/{sequence}/{head}"
        return f"{KEY_PREFIX}/{self.request}/{self.generation}/{layer_idx}/{block}{tail}"

    @property
    def record_key(self) -> str:
        """The request's record: which generation holds its blocks, and the admission record's parts."""
        return record_key(self.request)

    def publish(self, layer_idx: int, pool: HostKVPool, start: int = 0, end: int | None = None) -> int:
        """Put blocks [start, end) of `pool` (a local pool; default: every complete block) under this request's keys,
        one object per (block, sequence, KV head), `[2, *U]` (a unit as the pool holds it): each chunk's blocks are
        laid out unit-major in one staging copy and put by batched calls of at most `BATCH_OBJECTS` objects (the
        caller makes sure no copy into the pool is in flight). Returns the bytes put."""
        end = pool.num_blocks if end is None else end
        if end <= start:
            return 0
        if pool.first_block:
            raise ValueError("publish reads a local pool from block 0: call pool.fetch_all_remote() first.")
        self._check_open("publish blocks")
        B, H = pool.batch_size, pool.num_kv_heads
        total = 0
        for chunk, lo, hi, offset in pool.spans(start, end):
            staging = chunk[lo:hi].permute(0, 2, 3, 1, *range(4, chunk.dim())).contiguous()  # [n, B, H, 2, *U]
            units = staging.view(-1, *staging.shape[3:])
            size = units[0].numel() * units.element_size()
            keys = [self.key(layer_idx, start + offset + i, b, h)
                    for i in range(hi - lo) for b in range(B) for h in range(H)]
            addresses = [units.data_ptr() + r * size for r in range(len(keys))]
            status = in_slices(self.store, "batch_put_from", keys, addresses, [size] * len(keys))
            failed = [(k, st) for k, st in zip(keys, status) if st != 0]
            if failed:
                _KEPT_AFTER_FAILED_TRANSFER.append(staging)
                codes = sorted({st for _, st in failed})
                why = ("its storage is full: give the storage processes a larger --global_segment_size, or delete "
                       "requests no longer decoded" if NO_SPACE in codes else
                       "the transfer to its storage processes failed (one stopped, or cannot be reached in time): "
                       "check the store, then publish again" if TRANSFER_FAILED in codes else
                       "see Mooncake's ErrorCode for the status")
                raise RuntimeError(
                    f"Mooncake Store refused {len(failed)} of {len(keys)} objects of layer {layer_idx} (request "
                    f"{self.request!r}; first {failed[0][0]}, status {codes}): {why}.")
            total += size * len(keys)
        self.bytes_put += total
        return total

    def get_units(self, layer_idx: int, units, addresses, size: int, owner: torch.Tensor | None = None) -> int:
        """Get `units` (`[(block, sequence, KV head)]`) of layer `layer_idx`, each `size` bytes (`[2, *U]`), into
        `addresses` (host memory), by batched calls of at most `BATCH_OBJECTS` objects. Raises `RemoteBlocksMissing`
        naming them when the store lacks some. Returns the bytes got. `owner`: the tensor `addresses` point into,
        kept alive for good when a transfer fails otherwise than by a missing object (its I/O may still run)."""
        return self.get_units_of_layers([(layer_idx, units, addresses, owner)], size)

    def get_units_of_layers(self, requests, size: int) -> int:
        """`get_units` for several layers in one series of batched calls: `requests` is `[(layer_idx, units,
        addresses, owner)]` (a decode step's store reads of every layer: fewer, fuller calls)."""
        requests = [(idx, list(units), list(addresses), owner) for idx, units, addresses, owner in requests if units]
        if not requests:
            return 0
        self._check_open("fetch blocks")
        keys = [self.key(idx, *u) for idx, units, _, _ in requests for u in units]
        addresses = [a for _, _, layer_addresses, _ in requests for a in layer_addresses]
        got = in_slices(self.store, "batch_get_into", keys, addresses, [size] * len(keys))
        failures, at = [], 0
        for idx, units, _, owner in requests:
            layer_got, at = got[at : at + len(units)], at + len(units)
            missing = [u for u, n in zip(units, layer_got) if n != size]
            if missing:
                failures.append((idx, units, missing, sorted({n for n in layer_got if n != size}), owner))
        if failures:
            codes = sorted({code for *_, layer_codes, _ in failures for code in layer_codes})
            for *_, layer_codes, owner in failures:
                if owner is not None and any(code != NOT_FOUND for code in layer_codes):
                    _KEPT_AFTER_FAILED_TRANSFER.append(owner)
            where = "; ".join(
                f"{len(missing)} of {len(units)} (block, sequence, KV head) units of layer {idx} (blocks "
                f"{sorted({u[0] for u in missing})[:8]}{' ...' if len({u[0] for u in missing}) > 8 else ''})"
                for idx, units, missing, _, _ in failures[:3]) + ("; ..." if len(failures) > 3 else "")
            where = f"{where} of request {self.request!r} (status {codes})"
            if all(code == NOT_FOUND for code in codes):
                raise RemoteBlocksMissing(
                    f"{where} are not in the Mooncake Store: never published, deleted (the request's cache was reset "
                    f"or dropped), or lost when the store restarted. Publish the request again from its prefill.")
            raise RemoteBlocksMissing(
                f"{where} could not be read: the Mooncake Store did not serve them (its master or storage process "
                f"stopped, restarted or cannot be reached). Start the store again and publish the request again "
                f"from its prefill.")
        self.bytes_got += size * len(keys)
        return size * len(keys)

    def exists(self, layer_idx: int, blocks, sequence: int = 0, head: int = 0) -> list[bool]:
        keys = [self.key(layer_idx, int(b), sequence, head) for b in blocks]
        return [s == 1 for s in in_batches(self.store.batch_is_exist, keys)]

    def _check_open(self, what: str) -> None:
        """A closed client (closed by its caller, outside a `StoreClient`) crashes the process on most calls;
        `health_check` is safe: 0 open, 1 closed, 2 master unreachable."""
        status = self.store.health_check()
        if status != 0:
            raise ConnectionError(f"Cannot {what} for request {self.request!r}: the Mooncake Store client is "
                                  f"{'closed' if status == 1 else 'cut off from its master'} (health_check {status}).")

    def delete(self, generation_only: bool = False) -> int:
        """Remove every key of this request from the store (leases skipped), or only this generation's (a
        publication that failed, or one replaced). Returns how many were removed."""
        self._check_open("delete the keys")
        tail = f"{re.escape(self.generation)}/" if generation_only else ""
        return int(self.store.remove_by_regex(f"^{KEY_PREFIX}/{re.escape(self.request)}/{tail}", True))


def record_key(request: str) -> str:
    return f"{KEY_PREFIX}/{request}/record"


def cleanup(store, request: str) -> int:
    """Remove every key of `request` from the store: its record and every generation's blocks. For a request whose
    decode process died before it could (a cache deletes its request's keys when it is reset, closed or collected;
    a killed process does not). Returns how many keys were removed."""
    return RemoteTier(store, request).delete()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install 'oasis-cache[remote]' (Mooncake Store) and, on Debian / "
                                f"Ubuntu, apt-get install -y libibverbs1.")
    return found


@contextlib.contextmanager
def local_store(segment: str = "512MB", timeout: float = 30.0, storage: int = 1):
    """A Mooncake Store on this host for tests, benchmarks and demos: `mooncake_master` and `storage` storage
    processes (`mooncake_client`, `segment` of memory each) on free localhost ports, stopped on exit. Yields the
    master's "host:port" (for `connect`). Logs: a temporary folder, quoted in the error when the store does not come
    up."""
    logs = Path(tempfile.mkdtemp(prefix="oasis-mooncake-"))
    master = f"127.0.0.1:{_free_port()}"
    processes = []
    try:
        processes.append(subprocess.Popen(
            [_binary("mooncake_master"), f"--rpc_port={master.rsplit(':', 1)[1]}", f"--metrics_port={_free_port()}"],
            stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT))
        time.sleep(0.5)
        for index in range(storage):
            processes.append(subprocess.Popen(
                [_binary("mooncake_client"), f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE",
                 f"--global_segment_size={segment}", "--host=127.0.0.1", f"--port={_free_port()}"],
                stdout=open(logs / f"storage{index or ''}.log", "w"), stderr=subprocess.STDOUT))
        deadline = time.time() + timeout
        while True:
            try:
                store = connect(master)
                ok = store.put("oasis-probe/ready", b"1") == 0
                store.remove("oasis-probe/ready", True)
                store.close()
                mounted = (logs / "master.log").read_text().count("action=mount_segment")  # (every storage process:
                if ok and (storage == 1 or mounted >= storage):  # objects are placed over those mounted)
                    break
            except ConnectionError:
                pass
            if time.time() > deadline or any(p.poll() is not None for p in processes):
                raise RuntimeError(f"Mooncake Store did not start within {timeout:.0f} s (logs in {logs}): "
                                   f"{(logs / 'master.log').read_text()[-600:]} {(logs / 'storage.log').read_text()[-600:]}")
            time.sleep(0.5)
        yield master
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
