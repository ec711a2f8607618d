"""KV moved between two processes by Mooncake's transfer engine (dpserve/disagg/transfer.py): rows of
one pool written straight into another's registered pool, over TCP on loopback."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp

import pytest
import torch

from dpserve.bench import kv_transfer
from dpserve.disagg.transfer import HeadSlice, KVTransfer, PoolDescriptor, _batches, reslice, slot_runs
from dpserve.kvcache.pool import KVPool

SHAPES = [(2, 4), (2, 4)]  # GQA: keys and values, 2 KV heads of 4
WINDOW_LAYERS = frozenset({1})  # a hybrid pool: layer 1's rows are window slots


def make_pool(shapes=SHAPES, cache_dtype: torch.dtype | None = None) -> KVPool:
    return KVPool(3, 16, shapes, torch.float32, torch.device("cpu"), WINDOW_LAYERS, 8, cache_dtype)


def receive(descriptors: mp.Queue, results: mp.Queue, shapes=SHAPES, cache_dtype=None) -> None:
    """The decode side: registers a zeroed pool, hands out its descriptor, then its contents."""
    pool = make_pool(shapes, cache_dtype)
    transfer = KVTransfer("127.0.0.1")
    descriptors.put(transfer.register(pool).to_json())
    results.get()  # the writer is done
    results.put([buf.view(torch.uint8).numpy().copy() for buf in pool.buffers()])  # by value, as bytes
    transfer.close()


def test_slot_runs():
    assert slot_runs([3, 4, 5, 9, 10], [10, 11, 12, 2, 3]) == [(3, 10, 3), (9, 2, 2)]
    assert slot_runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]
    with pytest.raises(ValueError, match="3 source slots for 2 destination slots"):
        slot_runs([1, 2, 3], [1, 2])


def test_reslice_plans_each_destination_head_once():
    # MLA (one latent every rank holds): decode rank k from prefill rank k mod A_prefill.
    assert reslice(2, 4, 1) == [[(0, HeadSlice(0, 0, 1, 1, 1)), (2, HeadSlice(0, 0, 1, 1, 1))]] + [
        [(1, HeadSlice(0, 0, 1, 1, 1)), (3, HeadSlice(0, 0, 1, 1, 1))]
    ]
    # GQA, 4 KV heads: one prefill rank holding all four to two decode ranks of two each, and back.
    assert reslice(1, 2, 4) == [[(0, HeadSlice(0, 0, 2, 4, 2)), (1, HeadSlice(2, 0, 2, 4, 2))]]
    assert reslice(2, 1, 4) == [[(0, HeadSlice(0, 0, 2, 2, 4))], [(0, HeadSlice(0, 2, 2, 2, 4))]]
    # 2 KV heads over 4 prefill ranks (each replicated twice) to 2 decode ranks: one writer per head.
    assert reslice(4, 2, 2) == [[(0, HeadSlice(0, 0, 1, 1, 1))], [], [], [(1, HeadSlice(0, 0, 1, 1, 1))]]


def test_copies_are_batched_within_the_limit():
    batches = list(_batches([0, 100, 200], [1000, 2000, 3000], [30, 50, 10], 40))
    assert batches == [
        ([0, 100], [1000, 2000], [30, 10]),
        ([110], [2010], [40]),
        ([200], [3000], [10]),
    ]
    # ...and at most `copies` copies: a fragmented pool's thousands of small ones go in turns.
    small = list(_batches(list(range(5)), list(range(5)), [1] * 5, 40, copies=2))
    assert [b[0] for b in small] == [[0, 1], [2, 3], [4]]


def test_the_transfer_benchmark_moves_every_byte(capsys):
    kv_transfer.main(
        ["--model", "deepseek-v2-lite", "--tokens", "64", "--run", "16", "--repeat", "1", "--json"]
    )
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["bytes_per_token"] == 27 * 576 * 2  # V2-Lite: 27 layers of latent + rope, bfloat16
    assert r["bytes"] == 64 * r["bytes_per_token"] and r["buffers"] == 27
    assert set(r["vs_floor"]) == {"floor", "one run", "runs of 16"} and r["vs_floor"]["floor"] == 1.0


@contextlib.contextmanager
def peer_pool(shapes=SHAPES, cache_dtype: torch.dtype | None = None):
    """A random pool registered here and a zeroed one (`shapes`, `cache_dtype`) in a peer process: yields (this
    side's transfer engine and pool, the peer's descriptor, a function that ends the peer and
    returns its pool's buffers)."""
    ctx = mp.get_context("spawn")
    descriptors, results = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=receive, args=(descriptors, results, shapes, cache_dtype), daemon=True)
    peer.start()
    try:
        pool = make_pool(cache_dtype=cache_dtype)
        for buf in pool.buffers():
            buf.view(torch.uint8).random_()
        transfer = KVTransfer("127.0.0.1")
        transfer.register(pool)
        target = PoolDescriptor.from_json(descriptors.get(timeout=60))

        def received() -> list[torch.Tensor]:
            results.put("done")
            return [torch.from_numpy(buf) for buf in results.get(timeout=60)]

        yield transfer, pool, target, received
        transfer.close()
    finally:
        peer.join(timeout=60)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0


def test_rows_land_in_the_peers_pool():
    with peer_pool() as (transfer, pool, target, received):
        full, window = [0, 1, 4, 5], [2, 3]  # layers 0 and 2; layer 1's keys and values
        parts = [(full, [3, 4, 5, 9], [10, 11, 12, 2]), (window, [1, 2], [7, 5])]
        assert transfer.write(target, parts) == (4 * 4 + 2 * 2) * 2 * 4 * 4
        buffers = [buf.view(torch.uint8) for buf in pool.buffers()]
        for i, (src, dst) in enumerate(zip(buffers, received(), strict=True)):
            expected = torch.zeros_like(dst)
            for _, s_slots, d_slots in (p for p in parts if i in p[0]):
                expected[d_slots] = src[s_slots]
            assert torch.equal(dst, expected), f"buffer {i}"
        with pytest.raises(ValueError, match="the peer's pool differs"):
            transfer.write(PoolDescriptor(target.session, target.buffers[:2]), parts)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_heads_are_resliced_into_a_narrower_row(cache_dtype):
    """Attention TP 1 (both KV heads per row) into the second rank of attention TP 2 (one head per
    row): that rank's head lands in each destination slot, nothing else; an 8-bit pool's scale of
    that head with its codes."""
    with peer_pool([(1, 4), (1, 4)], cache_dtype) as (transfer, pool, target, received):
        [heads] = [h for k, h in reslice(1, 2, 2)[0] if k == 1]
        assert heads == HeadSlice(1, 0, 1, 2, 1)
        src, dst = [3, 4, 5], [6, 7, 9]
        per_layer = len(pool.buffers(0))  # keys and values; with their scales in an 8-bit pool
        full = [*range(per_layer), *range(2 * per_layer, 3 * per_layer)]  # layers 0 and 2
        transfer.write(target, [(full, src, dst)], heads)
        mine = [b.view(torch.uint8) for b in pool.buffers()]
        for i, (ours, theirs) in enumerate(zip(mine, received(), strict=True)):
            expected = torch.zeros_like(theirs)
            if i in full:
                expected[dst] = ours[src][:, 1:2]  # the second head
            assert torch.equal(theirs, expected), f"buffer {i}"
        with pytest.raises(ValueError, match="the peer's pool differs"):
            transfer.write(target, [([0], src, dst)])  # whole rows of 2 heads into rows of 1


def test_the_bootstrap_endpoint_survives_malformed_messages(tmp_path):
    """A peer's bytes are never trusted: messages that are not JSON, lack a room or a destination
    are dropped, and the endpoint still pairs the next room with its request."""
    import zmq

    from dpserve.disagg.bootstrap import PrefillBootstrap
    from dpserve.engine.worker_pool import free_port
    from dpserve.messages import Destination, KVDestination

    ctx = zmq.Context()
    collector = ctx.socket(zmq.PULL)
    collector.bind(f"ipc://{tmp_path}/collector")
    port = free_port()
    endpoint = PrefillBootstrap(port, 5, f"ipc://{tmp_path}/collector")
    peer = ctx.socket(zmq.DEALER)
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        for bad in (b"not json", b'{"room": "x"}', b'{"room": 1}', b'{"room": 1, "dest": 5}'):
            peer.send(bad)
        endpoint.add(2, "rid-2")
        peer.send_json({"room": 1, "dest": {"slots": [1]}})  # a destination without its other fields
        dest = Destination([1], [{"session": "s", "buffers": []}], 1, False, 0, [])
        peer.send_json({"room": 2, "dest": dest.wire()})
        assert collector.poll(10_000)
        assert collector.recv_pyobj() == KVDestination("rid-2", 2, dest)
        assert endpoint.alive
    finally:
        endpoint.close()
        ctx.destroy(linger=0)
