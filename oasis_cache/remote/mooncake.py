"""Complete blocks of a cache's host pools in a Mooncake Store.

One store object per (request, layer, block): the block's keys and values of every sequence and KV head,
`[2, B, Hkv, T, D]` — one contiguous run of the host pool's chunk (`pools/host_kv.py`), so a publish reads the chunk
in place (`batch_put_from`) and a fetch writes into it in place (`batch_get_into`), both batched over blocks. Keys:
`oasis/{request}/{layer}/{block}`. The bytes live in the store's storage processes (`mooncake_client`, or any client
that mounts a segment), not in the publishing process, which may exit once it has published.

    mooncake_master --rpc_port=50051 &
    mooncake_client --master_server_address=127.0.0.1:50051 --metadata_server=P2PHANDSHAKE \
        --global_segment_size=4GB --host=127.0.0.1 --port=50052 &

    store = connect("127.0.0.1:50051")
    tier = RemoteTier(store, request="req-7")
    tier.publish(layer_idx, pool)              # every complete block of the pool
    tier.fetch(layer_idx, pool, [3, 17, 18])   # those blocks into the pool's chunks
    tier.delete()                              # every key of the request
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..pools.host_kv import HostKVPool

KEY_PREFIX = "oasis"
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND


class RemoteBlocksMissing(RuntimeError):
    """Blocks a fetch asked for are not in the store (never published, deleted, or lost with a store restart)."""


def connect(master: str, *, hostname: str = "127.0.0.1", protocol: str = "tcp",
            metadata_server: str = "P2PHANDSHAKE", segment_bytes: int = 0, buffer_bytes: int = 64 << 20):
    """A `MooncakeDistributedStore` client of the master at `master` ("host:port").

    `segment_bytes`: storage this process lends the store (0, the default: none — the blocks live in the store's
    storage processes and outlive this one). `buffer_bytes`: the client's local transfer buffer."""
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
    store = MooncakeDistributedStore()
    status = store.setup(hostname, metadata_server, segment_bytes, buffer_bytes, protocol, "", master)
    if status != 0:
        raise ConnectionError(
            f"Could not join the Mooncake Store whose master is {master!r} (setup returned {status}). {start}")
    return store


class RemoteTier:
    """One request's blocks in a Mooncake Store.

    Args:
        store: a `MooncakeDistributedStore` (`connect`).
        request: the request's name, unique among live requests in the store (letters, digits, `-`, `_`, `.`).
    """

    def __init__(self, store, request: str):
        if not isinstance(request, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", request):
            raise ValueError(f"request must be a non-empty name of letters, digits, '-', '_' or '.', got {request!r}.")
        self.store = store
        self.request = request
        self.bytes_put = 0
        self.bytes_got = 0

    def key(self, layer_idx: int, block: int) -> str:
        return f"{KEY_PREFIX}/{self.request}/{layer_idx}/{block}"

    @staticmethod
    def _slabs(pool: HostKVPool, blocks) -> tuple[list[int], int]:
        """Addresses of blocks' `[2, B, Hkv, T, D]` runs in the pool's chunks, and the bytes of one run."""
        C = pool.chunk_blocks
        for block in blocks:
            if not 0 <= block < pool.capacity_blocks:
                raise IndexError(f"block {block} is outside the pool ({pool.capacity_blocks} blocks reserved)")
        addresses = [pool.chunks[b // C][b % C].data_ptr() for b in blocks]
        return addresses, pool.block_nbytes

    def publish(self, layer_idx: int, pool: HostKVPool, start: int = 0, end: int | None = None) -> int:
        """Put blocks [start, end) of `pool` (default: every complete block) under this request's keys, read in
        place from the pool's chunks (the caller makes sure no copy into them is in flight). Returns the bytes put."""
        end = pool.num_blocks if end is None else end
        blocks = list(range(start, end))
        if not blocks:
            return 0
        self._check_open("publish blocks")
        addresses, size = self._slabs(pool, blocks)
        status = self.store.batch_put_from([self.key(layer_idx, b) for b in blocks], addresses, [size] * len(blocks))
        failed = [(b, s) for b, s in zip(blocks, status) if s != 0]
        if failed:
            raise RuntimeError(f"Mooncake Store refused {len(failed)} of {len(blocks)} blocks of layer {layer_idx} "
                               f"(request {self.request!r}; first block {failed[0][0]}, status {failed[0][1]}): "
                               f"is its storage full? Give the storage processes a larger --global_segment_size.")
        self.bytes_put += size * len(blocks)
        return size * len(blocks)

    def fetch(self, layer_idx: int, pool: HostKVPool, blocks) -> int:
        """Get `blocks` (ids) of layer `layer_idx` into the pool's chunks, in place (reserved beforehand:
        `pool.reserve`). Raises `RemoteBlocksMissing` naming them when the store lacks some. Returns the bytes got."""
        blocks = [int(b) for b in blocks]
        if not blocks:
            return 0
        self._check_open("fetch blocks")
        addresses, size = self._slabs(pool, blocks)
        got = self.store.batch_get_into([self.key(layer_idx, b) for b in blocks], addresses, [size] * len(blocks))
        missing = [b for b, n in zip(blocks, got) if n != size]
        if missing:
            codes = sorted({n for b, n in zip(blocks, got) if n != size})
            raise RemoteBlocksMissing(
                f"{len(missing)} of {len(blocks)} blocks of layer {layer_idx} of request {self.request!r} are not in "
                f"the Mooncake Store (blocks {missing[:8]}{' ...' if len(missing) > 8 else ''}; status {codes}): "
                f"never published, deleted (the request's cache was reset or dropped), or lost when the store "
                f"restarted. Publish the request again from its prefill.")
        self.bytes_got += size * len(blocks)
        return size * len(blocks)

    def exists(self, layer_idx: int, blocks) -> list[bool]:
        return [s == 1 for s in self.store.batch_is_exist([self.key(layer_idx, int(b)) for b in blocks])]

    def _check_open(self, what: str) -> None:
        """A closed client crashes the process on most calls; `health_check` is safe: 0 open, 1 closed, 2 master
        unreachable."""
        status = self.store.health_check()
        if status != 0:
            raise ConnectionError(f"Cannot {what} for request {self.request!r}: the Mooncake Store client is "
                                  f"{'closed' if status == 1 else 'cut off from its master'} (health_check {status}).")

    def delete(self) -> int:
        """Remove every key of this request from the store (leases skipped). Returns how many were removed."""
        self._check_open("delete the keys")
        return int(self.store.remove_by_regex(f"^{KEY_PREFIX}/{re.escape(self.request)}/", True))


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
def local_store(segment: str = "512MB", timeout: float = 30.0):
    """A Mooncake Store on this host for tests, benchmarks and demos: `mooncake_master` and one storage process
    (`mooncake_client`, `segment` of memory) on free localhost ports, stopped on exit. Yields the master's
    "host:port" (for `connect`). Logs: a temporary folder, quoted in the error when the store does not come up."""
    logs = Path(tempfile.mkdtemp(prefix="oasis-mooncake-"))
    master = f"127.0.0.1:{_free_port()}"
    processes = []
    try:
        processes.append(subprocess.Popen(
            [_binary("mooncake_master"), f"--rpc_port={master.rsplit(':', 1)[1]}", f"--metrics_port={_free_port()}"],
            stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT))
        time.sleep(0.5)
        processes.append(subprocess.Popen(
            [_binary("mooncake_client"), f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE",
             f"--global_segment_size={segment}", "--host=127.0.0.1", f"--port={_free_port()}"],
            stdout=open(logs / "storage.log", "w"), stderr=subprocess.STDOUT))
        deadline = time.time() + timeout
        while True:
            try:
                store = connect(master)
                ok = store.put("oasis-probe/ready", b"1") == 0
                store.remove("oasis-probe/ready", True)
                store.close()
                if ok:
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
