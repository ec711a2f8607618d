"""The LM head's collectives under DP attention, on 4 gloo ranks (tp=4, dp=2, 2 ranks per group):
every group's rows gathered exactly, without all-reducing a zero-padded buffer, and logits sent in
the model's dtype, upcast to float32 on arrival, equal to one big matmul's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from dpserve import distributed
from dpserve.distributed import Topology, init_groups
from dpserve.engine.worker_pool import free_port
from dpserve.layers.dp_comm import DPComm
from dpserve.models.base import CausalLM
from dpserve.step.records import StepLayout

WORLD, DP, HIDDEN, VOCAB = 4, 2, 8, 30
LOGIT_ROWS = [(3, 0), (5, 2), (1, 1)]  # rows each group samples, per step


def _group_rows(g: int, n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(10 + g)).to(torch.bfloat16)


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    topo = Topology(WORLD, DP, rank)
    groups = init_groups(topo, "cpu", f"127.0.0.1:{port}", timeout_s=120)
    sent: list[tuple[str, torch.dtype, int]] = []

    def spy(name, original, sent_arg):
        def call(*args, **kwargs):
            x = args[sent_arg]
            sent.append((name, x.dtype, x.numel() * x.element_size()))
            return original(*args, **kwargs)

        return call

    # Records what every collective this rank joins carries (dpserve.distributed's own aliases too).
    dist.all_reduce = spy("all_reduce", dist.all_reduce, 0)
    dist.all_to_all_single = spy("all_to_all_single", dist.all_to_all_single, 1)
    distributed._all_gather_single = spy("all_gather", distributed._all_gather_single, 1)
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    a = topo.attn_tp_size
    out = {}
    for step, counts in enumerate(LOGIT_ROWS):
        every = [_group_rows(g, n) for g, n in enumerate(counts)]
        layout = StepLayout("sum_len", counts, counts, topo.dp_rank, a)
        for dp_head in (False, True):
            shard_rows = -(-VOCAB // (a if dp_head else WORLD))
            shard_rank = topo.attn_tp_rank if dp_head else rank
            shard = F.pad(weight, (0, 0, 0, shard_rows * (a if dp_head else WORLD) - VOCAB))
            model = SimpleNamespace(
                dp_lm_head=dp_head,
                comm=DPComm(groups),
                groups=groups,
                cfg=SimpleNamespace(vocab_size=VOCAB),
                lm_head=shard[shard_rank * shard_rows : (shard_rank + 1) * shard_rows],
            )
            sent.clear()
            if not dp_head:
                gathered = model.comm.gather_logit_rows(every[topo.dp_rank], layout)
                assert torch.equal(gathered, torch.cat(every)), (rank, step)
                gather_sent = list(sent)
                sent.clear()
            logits = CausalLM.lm_head_logits(model, every[topo.dp_rank], layout)
            # Each vocabulary shard's matmul over the same rows, as the ranks compute them.
            rows = every[topo.dp_rank] if dp_head else torch.cat(every)
            full = torch.cat([F.linear(rows, part) for part in shard.split(shard_rows)], 1)[:, :VOCAB]
            start = 0 if dp_head else sum(counts[: topo.dp_rank])
            expected = full[start : start + counts[topo.dp_rank]].float()
            assert logits.dtype == torch.float32 and torch.equal(logits, expected), (rank, step, dp_head)
            out[(step, dp_head)] = (gather_sent if not dp_head else [], list(sent))
    results[rank] = out
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sent():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(free_port(), results), nprocs=WORLD, start_method="spawn")
        return dict(results)


def test_logit_rows_all_gathered_in_the_model_dtype(sent):
    """Each rank of a group sends its half of the group's rows to every rank: one all-to-all of
    4 x its rows in bfloat16, where an all-reduce would send every group's rows (zero-padded)."""
    assert sorted(sent) == list(range(WORLD))
    for rank, steps in sent.items():
        own = rank % (WORLD // DP)
        for step, counts in enumerate(LOGIT_ROWS):
            n = counts[rank // (WORLD // DP)]
            mine = max(0, min(-(-n // 2), n - own * -(-n // 2)))
            gather, _ = steps[(step, False)]
            assert gather == [("all_to_all_single", torch.bfloat16, WORLD * mine * HIDDEN * 2)], (rank, step)


def test_logits_sent_in_the_model_dtype(sent):
    """The LM head's logits cross ranks in bfloat16 (half of float32's bytes); every collective of
    both LM head forms carries bfloat16."""
    for steps in sent.values():
        for (step, dp_head), (_, head) in steps.items():
            assert head and {dtype for _, dtype, _ in head} == {torch.bfloat16}, (step, dp_head, head)
            assert not any(name == "all_reduce" for name, _, _ in head)
