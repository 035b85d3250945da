"""Shape grid for the block-gather kernel, shared by the CPU (Triton interpreter) and GPU tests. Run as a script,
it checks every case on the given device and prints one line per case."""

from __future__ import annotations

import sys

import torch

from oasis_cache.kernels.gather import gather_blocks
from oasis_cache.memory import TransferEngine
from oasis_cache.pools import HostKVPool, WorkingSet

# (B, Hkv, T, D, S, NB, chunk_blocks, dtype)
CASES = [
    (1, 1, 16, 64, 4, 9, 4, torch.float32),
    (2, 3, 16, 64, 5, 13, 5, torch.bfloat16),
    (3, 2, 8, 80, 3, 7, 2, torch.float16),  # head_dim 80: T*D not a power of two
    (2, 2, 4, 5, 6, 17, 3, torch.float32),  # odd everything
]


def check_case(B, H, T, D, S, NB, C, dtype, device) -> bool:
    g = torch.Generator().manual_seed(B * 1000 + D)
    pool = HostKVPool(B, H, D, T, dtype, C, pin_memory=device.type == "cuda")
    engine = TransferEngine("torch", torch.device("cpu"))
    data = torch.randn(2, B, H, NB, T, D, generator=g).to(dtype)
    engine.offload(pool, data)
    ws = WorkingSet(B, H, S, T, D, dtype, device)
    ws.kv.fill_(-7.0)  # poison: every written element must change, every other must stay
    K = min(S, NB)
    block_ids = torch.stack([torch.randperm(NB, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    dest = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    fetch = torch.rand(B, H, K, generator=g) < 0.7
    addrs = torch.tensor([c.data_ptr() for c in pool.chunks], dtype=torch.int64, device=device)
    gather_blocks(addrs, C, block_ids.to(device), dest.to(device), fetch.to(device), ws.kv)
    got = ws.kv.cpu()
    expected = torch.full_like(got, -7.0)
    for b in range(B):
        for h in range(H):
            for k in range(K):
                if fetch[b, h, k]:
                    expected[:, b, h, dest[b, h, k]] = data[:, b, h, block_ids[b, h, k]]
    return torch.equal(got, expected)


if __name__ == "__main__":
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    ok = True
    for case in CASES:
        result = check_case(*case, device=device)
        ok &= result
        print(case, "OK" if result else "MISMATCH")
    sys.exit(0 if ok else 1)
