"""One layer's decode attention over an 8-bit KV cache beside the model's dtype, on the CPU.

    python -m dpserve.bench.kv_dtype --dtype float32 --shapes 1,9,3,64,8000 8,9,3,64,2048

Each shape (rows, heads, KV heads, head dim, keys per row) reads a pool (consecutive slots per row, or
scattered ones) through the engine's reader (`TorchBackend`'s one-query path: the fused C++ kernel where it is built, an 8-bit
cache's codes widened inside it), every cache dtype side by side in one run; prints microseconds
per call (the fastest of --repeat rounds, the dtypes interleaved) and each pool's bytes per token.
"""

from __future__ import annotations

import argparse
import time

import torch

from dpserve import cpu_ops
from dpserve.attention.backend import AttentionMetadata
from dpserve.attention.torch_backend import _Keys
from dpserve.config import DTYPES, KV_CACHE_DTYPES
from dpserve.kvcache.pool import KVPool, entry_bytes


def measure(
    shape: tuple[int, ...], dtype: torch.dtype, cache_dtypes: list[torch.dtype], repeat: int, scattered: bool
) -> list[float]:
    """Microseconds per call for each cache dtype: the fastest of `repeat` rounds, the dtypes' calls
    interleaved within each round (so that a noisy neighbour slows them alike)."""
    rows, heads, kv_heads, dim, keys = shape
    g = torch.Generator().manual_seed(0)
    slots = rows * keys
    k, v = torch.randn(2, slots + 1, kv_heads, dim, generator=g)
    order = torch.randperm(slots, generator=g) if scattered else torch.arange(slots)
    table = (order + 1).to(torch.int32).view(rows, keys)
    meta = AttentionMetadata(
        table,
        torch.arange(rows, dtype=torch.int32),
        torch.full((rows,), keys, dtype=torch.int32),
        torch.arange(rows + 1, dtype=torch.int32),
        rows,
        1,
        keys,
    )
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    caches = []
    for cache_dtype in cache_dtypes:
        pool = KVPool(1, slots, [(kv_heads, dim)] * 2, dtype, torch.device("cpu"), cache_dtype=cache_dtype)
        pool.write(0, torch.arange(slots + 1), k, v)
        caches.append(pool.layers[0])
    best = [float("inf")] * len(caches)
    for _ in range(repeat):
        for i, (kc, vc) in enumerate(caches):
            start = time.perf_counter()
            _Keys(meta).attend(q, kc, vc, dim, dim**-0.5)
            best[i] = min(best[i], time.perf_counter() - start)
    return [t * 1e6 for t in best]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dpserve.bench.kv_dtype", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's dtype")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["1,9,3,64,8000", "8,9,3,64,2048", "32,9,3,64,1024", "16,32,8,128,1024"],
        help="rows,heads,kv_heads,head_dim,keys per row",
    )
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument(
        "--scattered",
        action="store_true",
        help="each row's keys in random slots (default: consecutive slots, as a request's prefill takes them)",
    )
    args = p.parse_args(argv)
    print(
        f"fused CPU kernel: {'built' if cpu_ops.load() else 'not built (plain PyTorch)'}; threads {torch.get_num_threads()}"
    )
    dtype = DTYPES[args.dtype]
    kinds = {args.dtype: dtype, **KV_CACHE_DTYPES}
    print(
        f"| shape (rows, heads/KV heads, dim, keys) | {' | '.join(f'{k} (us)' for k in kinds)} | bytes/token/layer |"
    )
    print(f"|---|{'---:|' * len(kinds)}---|")
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        us = measure(shape, dtype, list(kinds.values()), args.repeat, args.scattered)
        rows, heads, kv_heads, dim, keys = shape
        sizes = " / ".join(str(2 * entry_bytes((kv_heads, dim), c)) for c in kinds.values())
        print(
            f"| {rows}, {heads}/{kv_heads}, {dim}, {keys} | {' | '.join(f'{t:,.0f}' for t in us)} | {sizes} |"
        )


if __name__ == "__main__":
    main()
