"""What moving one request's KV between instances costs (prefill-decode disaggregation,
dpserve/disagg/transfer.py), against the transfer engine's own bandwidth measured in the same run.

    python -m dpserve.bench.kv_transfer --model deepseek-v2-lite --tokens 2048

Two processes on this machine, each with the model's KV pool at tp 1 (the planner's meta model
gives its layers and entries) registered with Mooncake's transfer engine over TCP on loopback. The
floor: one contiguous write of the request's bytes between two registered buffers. Then the
request's KV written pool to pool as the prefill side writes it: every layer's rows, its slots in
one run (a fresh allocation) and in runs of `--run` slots (a pool fragmented by churn).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from dpserve.bench.floor import engine_model
from dpserve.disagg.transfer import KVTransfer, PoolDescriptor
from dpserve.kvcache.pool import KVPool

HOST = "127.0.0.1"


def make_pool(model_path: str, dtype: str, tokens: int) -> tuple[KVPool, int]:
    """The model's KV pool at tp 1 with room for `tokens` tokens twice over, and its bytes per token."""
    model, model_cfg, cfg = engine_model(model_path, dtype)
    shapes = model.kv_entry_shapes()
    pool = KVPool(model_cfg.num_layers, 2 * tokens, shapes, cfg.torch_dtype, torch.device("cpu"))
    per_token = sum(buf.stride(0) * buf.element_size() for buf in pool.buffers())
    return pool, per_token


def receiver(model_path: str, dtype: str, tokens: int, out: mp.Queue, done: mp.Queue) -> None:
    pool, per_token = make_pool(model_path, dtype, tokens)
    scratch = torch.empty(tokens * per_token, dtype=torch.uint8)
    transfer = KVTransfer(HOST)
    descriptor = transfer.register(pool)
    transfer.engine.register_memory(scratch.data_ptr(), scratch.nbytes)
    out.put((descriptor.to_json(), scratch.data_ptr()))
    done.get()
    transfer.close()


def _seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(model_path: str, dtype: str, tokens: int, run_len: int, repeat: int) -> dict:
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=receiver, args=(model_path, dtype, tokens, out, done), daemon=True)
    peer.start()
    try:
        pool, per_token = make_pool(model_path, dtype, tokens)
        for buf in pool.buffers():
            buf.view(torch.uint8).random_()
        transfer = KVTransfer(HOST)
        transfer.register(pool)
        descriptor, peer_scratch = out.get(timeout=120)
        target = PoolDescriptor.from_json(descriptor)
        total = tokens * per_token
        scratch = torch.empty(total, dtype=torch.uint8).random_()
        transfer.engine.register_memory(scratch.data_ptr(), total)

        def raw() -> None:
            if (
                transfer.engine.transfer_sync_write(target.session, scratch.data_ptr(), peer_scratch, total)
                != 0
            ):
                raise RuntimeError("the raw transfer failed")

        buffers = range(len(target.buffers))
        src = list(range(1, tokens + 1))
        contiguous = [(buffers, src, list(range(tokens + 1, 2 * tokens + 1)))]
        # Fragmented: runs of run_len slots, in reverse order in the destination pool (none adjacent).
        runs = tokens // run_len
        dst = [tokens + 1 + (runs - 1 - i // run_len) * run_len + i % run_len for i in range(tokens)]
        fragmented = [(buffers, src, dst)]
        raw_s = _seconds(raw, repeat)
        results = {"floor": raw_s}
        for label, parts in (("one run", contiguous), (f"runs of {run_len}", fragmented)):
            assert transfer.write(target, parts) == total
            results[label] = _seconds(lambda parts=parts: transfer.write(target, parts), repeat)
        done.put("done")
        transfer.close()
    finally:
        peer.join(timeout=60)
        if peer.is_alive():
            peer.kill()
    return {
        "model": model_path,
        "dtype": dtype,
        "tokens": tokens,
        "bytes_per_token": per_token,
        "bytes": total,
        "buffers": len(target.buffers),
        "seconds": results,
        "gb_per_s": {k: total / s / 1e9 for k, s in results.items()},
        "vs_floor": {k: raw_s / s for k, s in results.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", help="bundled config name or model path")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens of the request moved")
    p.add_argument("--run", type=int, default=16, help="slots per run in the fragmented case")
    p.add_argument("--repeat", type=int, default=5, help="transfers timed per case (the median is kept)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    if args.tokens % args.run:
        p.error(f"--tokens {args.tokens} must be a multiple of --run {args.run}")
    r = run(args.model, args.dtype, args.tokens, args.run, args.repeat)
    if args.json:
        print(json.dumps(r))
        return
    print(
        f"{r['model']} ({r['dtype']}): {r['tokens']} tokens x {r['bytes_per_token']} bytes = "
        f"{r['bytes'] / 2**20:.1f} MiB in {r['buffers']} pool buffers"
    )
    for label, s in r["seconds"].items():
        print(
            f"  {label:>12}: {s * 1e3:8.2f} ms  {r['gb_per_s'][label]:6.2f} GB/s  {r['vs_floor'][label]:.2f}x the floor"
        )


if __name__ == "__main__":
    main()
