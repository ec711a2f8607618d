"""Prefill-decode disaggregation on one rank: its KV pool registered with the transfer engine, its
group's pool descriptors (which a decode leader sends with each request's slots), and on the
prefill side the writes of finished prompts' KV into the decode ranks that hold those heads."""

from __future__ import annotations

import logging

import torch

from dpserve.disagg.bootstrap import local_host
from dpserve.disagg.transfer import KVTransfer, PoolDescriptor, reslice
from dpserve.distributed import Groups
from dpserve.kvcache.pool import KVPool
from dpserve.messages import Destination
from dpserve.step.records import KVSend

logger = logging.getLogger("dpserve.disagg")


class KVSender:
    def __init__(
        self,
        pool: KVPool,
        groups: Groups,
        window_layers: frozenset[int],  # the hybrid pool's window layers (their rows go to window slots)
        window_size: int,  # their window (0: no hybrid pool)
        kv_heads: int,  # KV heads this rank holds (MLA: 1, its latent, on every rank)
        nextn: bool,  # the pool holds the MTP layer's KV too
    ):
        self.groups, self.window_size, self.kv_heads, self.nextn = groups, window_size, kv_heads, nextn
        self.transfer = KVTransfer(local_host())
        local = self.transfer.register(pool).to_json()
        # The pool's buffers, layer by layer: window layers' rows go to window slots, the others' to
        # full slots.
        per_layer = len(pool.buffers(0))
        layer_of = [i // per_layer for i in range(len(self.transfer.local.buffers))]
        self.full_buffers = [i for i, layer in enumerate(layer_of) if layer not in window_layers]
        self.window_buffers = [i for i, layer in enumerate(layer_of) if layer in window_layers]
        self.group_pools = [local]
        if groups.attn_tp_cpu is not None:
            self.group_pools = [None] * groups.topo.attn_tp_size
            torch.distributed.all_gather_object(self.group_pools, local, group=groups.attn_tp_cpu)

    def destination(self, slots: list[int], window_slots: list[int]) -> Destination:
        """Decode side: where a request's KV goes in this group (`window_slots`: the hybrid pool's
        slots of the prompt's last W - 1 positions)."""
        return Destination(slots, self.group_pools, self.kv_heads, self.nextn, self.window_size, window_slots)

    def write(self, sends: list[KVSend], device: torch.device) -> list[str | None]:
        """Prefill side, every rank of the group: writes its share of each request's KV into the
        decode ranks that hold those heads (`reslice`: MLA's latent, held by every rank, to decode
        rank k from prefill rank k mod A); returns each send's error (None: written), as the whole
        group saw it."""
        topo = self.groups.topo
        a, j = topo.attn_tp_size, topo.attn_tp_rank
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the prompts' KV is written by earlier steps
        errors: list[str | None] = []
        for send in sends:
            dest = send.dest
            try:
                self._check(dest)
                parts = [(self.full_buffers, send.slots, dest.slots)]
                if self.window_buffers:
                    parts.append((self.window_buffers, send.window_slots, dest.window_slots))
                for k, heads in reslice(a, len(dest.ranks), self.kv_heads)[j]:
                    self.transfer.write(PoolDescriptor.from_json(dest.ranks[k]), parts, heads)
                errors.append(None)
            except (RuntimeError, ValueError, KeyError, TypeError) as e:
                logger.error("writing a request's KV failed: %s", e)
                errors.append(str(e))
        if self.groups.attn_tp_cpu is not None:
            seen: list = [None] * a
            torch.distributed.all_gather_object(seen, errors, group=self.groups.attn_tp_cpu)
            errors = [next((e for e in column if e is not None), None) for column in zip(*seen, strict=True)]
        return errors

    def _check(self, dest: Destination) -> None:
        """Raises ValueError, naming both sides, where the two instances' pools do not match."""
        if dest.kv_heads != self.kv_heads:
            raise ValueError(
                f"the decode instance's model has {dest.kv_heads} KV head(s), this one {self.kv_heads}"
            )
        if dest.window_size != self.window_size:
            raise ValueError(
                f"sliding-window layers keep a hybrid pool with a {dest.window_size}-token window "
                f"on the decode instance, {self.window_size} here (0: none): start both with or "
                "without --disable-hybrid-swa-memory"
            )
        if dest.nextn != self.nextn:
            on = "the decode instance" if dest.nextn else "this prefill instance"
            raise ValueError(
                f"{on} alone runs --speculative-algorithm NEXTN: run it on both (the prefill "
                "side sends the MTP layer's KV and first drafts) or on neither"
            )

    def close(self) -> None:
        self.transfer.close()
