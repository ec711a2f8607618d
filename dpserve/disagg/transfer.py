"""KV moved between instances for prefill-decode disaggregation: Mooncake's transfer engine writes
rows of one instance's KV pool straight into another's.

Each side registers every buffer of its pool once (`KVTransfer.register`); its `PoolDescriptor`
(the transfer engine's session address, each buffer's base address and bytes per slot row) is all a
peer needs to find where a slot's row lives. Writing a request's KV is one batched call: for each
buffer, each run of slots consecutive on both sides is one contiguous copy (a freshly allocated
request's slots are mostly one run), never a copy per token. Buffers are the pool's, layer by
layer, each layer's entries in order (MLA: latent, then V3.2's indexer key; GQA: keys, values), so
a part of a write names the buffers it covers: a hybrid pool's window layers take window slots.

When the two instances split attention over different numbers of ranks, each rank holds other KV
heads (GQA: its share of them, or one replicated; MLA's latent is one head every rank holds):
`reslice` plans which source rank writes which heads to which destination rank, and a write of part
of a row copies those heads of each slot (a row holds its heads one after another).

The CPU wheel (`mooncake-transfer-engine-non-cuda`, which needs Debian's `libibverbs1`) moves host
memory over TCP, the only transport the worker starts (`KVTransfer(host)`); the CUDA wheel's RDMA
and NVLink transports take the same calls with another `protocol`, but nothing selects them yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpserve.kvcache.pool import KVPool

BATCH_BYTES = 16 << 20  # bytes per batched transfer call
BATCH_COPIES = 256  # copies per batched transfer call


@dataclass(frozen=True)
class PoolDescriptor:
    session: str  # "host:port" of the owner's transfer engine
    buffers: tuple[tuple[int, int], ...]  # (base address, bytes per slot row) of each pool buffer

    def to_json(self) -> dict:
        return {"session": self.session, "buffers": [list(b) for b in self.buffers]}

    @classmethod
    def from_json(cls, data: dict) -> PoolDescriptor:
        return cls(data["session"], tuple((int(a), int(n)) for a, n in data["buffers"]))


@dataclass(frozen=True)
class HeadSlice:
    """Heads [src_first, src_first + count) of each source row into [dst_first, ...) of each
    destination row, the rows holding `src_heads` and `dst_heads` heads."""

    src_first: int
    dst_first: int
    count: int
    src_heads: int
    dst_heads: int

    @property
    def whole(self) -> bool:
        return self.count == self.src_heads == self.dst_heads


def head_range(rank: int, attn_tp: int, kv_heads: int) -> range:
    """The KV heads attention-TP rank `rank` of `attn_tp` holds: kv_heads / attn_tp of them, or one
    (replicated) when there are fewer heads than ranks; MLA's latent counts as one head."""
    start = rank * kv_heads // attn_tp
    return range(start, start + max(kv_heads // attn_tp, 1))


def reslice(src_tp: int, dst_tp: int, kv_heads: int) -> list[list[tuple[int, HeadSlice]]]:
    """Per source rank, the (destination rank, heads) it writes so that every destination rank gets
    each of its heads once. A head several source ranks hold comes to destination rank k from
    the (k mod holders)-th of them: writers spread over the holders (MLA: rank k mod src_tp)."""
    plan: list[list[tuple[int, HeadSlice]]] = [[] for _ in range(src_tp)]
    src = [head_range(j, src_tp, kv_heads) for j in range(src_tp)]
    for k in range(dst_tp):
        dst = head_range(k, dst_tp, kv_heads)
        for h in dst:
            holders = [j for j in range(src_tp) if h in src[j]]
            j = holders[k % len(holders)]
            runs = plan[j]
            last = runs[-1] if runs else None
            if last and last[0] == k and last[1].src_first + last[1].count == h - src[j].start:
                runs[-1] = (
                    k,
                    HeadSlice(last[1].src_first, last[1].dst_first, last[1].count + 1, len(src[j]), len(dst)),
                )
            else:
                runs.append((k, HeadSlice(h - src[j].start, h - dst.start, 1, len(src[j]), len(dst))))
    return plan


def _batches(srcs: list[int], dsts: list[int], lens: list[int], limit: int, copies: int = BATCH_COPIES):
    """The copies in batches of at most `limit` bytes (a larger copy split) and `copies` copies: the
    TCP transport queues a batch's slices at once and refuses a queue it cannot hold (64 MiB failed
    here, and so did thousands of small copies, a fragmented pool's, at once)."""
    batch: tuple[list[int], list[int], list[int]] = ([], [], [])
    size = 0
    for src, dst, n in zip(srcs, dsts, lens, strict=True):
        while n > 0:
            take = min(n, limit - size)
            for part, value in zip(batch, (src, dst, take), strict=True):
                part.append(value)
            src, dst, n, size = src + take, dst + take, n - take, size + take
            if size == limit or len(batch[0]) == copies:
                yield batch
                batch, size = ([], [], []), 0
    if size:
        yield batch


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(source start, destination start, length) of the runs of slot pairs consecutive on both sides."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots for {len(dst)} destination slots")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class KVTransfer:
    """One rank's transfer engine and its registered pool."""

    def __init__(self, host: str, protocol: str = "tcp", device_name: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # the wheel, or the libibverbs it links
            raise RuntimeError(
                f"Mooncake's transfer engine cannot be loaded ({e}): install mooncake-transfer-engine "
                "(GPU) or mooncake-transfer-engine-non-cuda (CPU; it needs the libibverbs1 package)"
            ) from e
        self.engine = TransferEngine()
        # P2P handshake: peers find each other by the session address alone, no metadata server.
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise RuntimeError(f"the transfer engine did not start on {host} over {protocol}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.local: PoolDescriptor | None = None
        self._registered: list[int] = []

    def register(self, pool: KVPool) -> PoolDescriptor:
        """Registers every buffer of `pool` (once) and describes it for peers."""
        buffers = pool.buffers()
        addrs = [b.data_ptr() for b in buffers]
        if self.engine.batch_register_memory(addrs, [b.nbytes for b in buffers]) != 0:
            raise RuntimeError(f"the transfer engine could not register the KV pool's {len(buffers)} buffers")
        self._registered = addrs
        rows = [b.stride(0) * b.element_size() for b in buffers]
        self.local = PoolDescriptor(self.session, tuple(zip(addrs, rows, strict=True)))
        return self.local

    def write(
        self,
        peer: PoolDescriptor,
        parts: list[tuple[range | list[int], list[int], list[int]]],
        heads: HeadSlice | None = None,
    ) -> int:
        """Writes rows of the registered pool into `peer`'s: each part is (buffer indices, source
        slots, destination slots); `heads`: only those heads of each row (None: whole rows). One
        batched call; returns the bytes moved."""
        local = self.local
        if local is None:
            raise RuntimeError("no pool registered")
        heads = heads or HeadSlice(0, 0, 1, 1, 1)
        if len(peer.buffers) != len(local.buffers) or any(
            row * heads.dst_heads != peer_row * heads.src_heads
            for (_, row), (_, peer_row) in zip(local.buffers, peer.buffers, strict=False)
        ):
            raise ValueError(
                f"the peer's pool differs: {len(peer.buffers)} buffers of "
                f"{sorted({n for _, n in peer.buffers})} bytes per row ({heads.dst_heads} head(s)), this one "
                f"{len(local.buffers)} of {sorted({n for _, n in local.buffers})} ({heads.src_heads} head(s))"
            )
        srcs, dsts, lens = [], [], []
        for buffers, src, dst in parts:
            runs = slot_runs(src, dst)
            for i in buffers:
                (base, row), (peer_base, peer_row) = local.buffers[i], peer.buffers[i]
                if heads.whole:  # whole rows: one copy per run of slots
                    for s, d, n in runs:
                        srcs.append(base + s * row)
                        dsts.append(peer_base + d * row)
                        lens.append(n * row)
                    continue
                unit = row // heads.src_heads  # bytes of one head's entry
                for s, d in zip(src, dst, strict=True):  # part of each row: a copy per slot
                    srcs.append(base + s * row + heads.src_first * unit)
                    dsts.append(peer_base + d * peer_row + heads.dst_first * unit)
                    lens.append(heads.count * unit)
        for batch in _batches(srcs, dsts, lens, BATCH_BYTES):
            if self.engine.batch_transfer_sync_write(peer.session, *batch) != 0:
                raise RuntimeError(f"writing {sum(batch[2])} bytes of KV to {peer.session} failed")
        return sum(lens)

    def close(self) -> None:
        if self._registered:
            self.engine.batch_unregister_memory(self._registered)
            self._registered = []
