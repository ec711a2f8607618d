"""Captured decode steps are free of host syncs by construction (docs/design.md, section 4).

On a GPU the padded decode step is captured as a CUDA graph; an op whose output shape or value must
reach the host (bincount's maximum, nonzero, unique, masked_select, .item(), .tolist(), a bool
mask index) or a tensor built from host data inside it (a pageable host-to-device copy) fails the
capture, or worse, is frozen into it. Here the step the graphs capture (`forward_hidden` of a
padded layout, with the GPU's kernels: Triton attention and the fused MoE, in the interpreter) runs
under a dispatch mode that raises on every such op, in each layout and dispatch path: one rank,
TP MoE, EP gathering rows, EP all_to_all (fixed capacity), both padding modes, decode and verify
rows, an idle group beside a decoding one."""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from dpserve.config import EngineConfig
from dpserve.distributed import init_groups
from dpserve.engine.worker_pool import free_port
from dpserve.layers import mlp
from dpserve.models.config import ModelConfig
from dpserve.step.exchange import exchange
from dpserve.step.records import BatchKind, BatchReq, GroupBatch
from dpserve.worker.model_runner import ModelRunner

# Ops whose result the host must see before the next op can be issued (or that copy host data).
SYNCING = {
    "bincount",
    "nonzero",
    "nonzero_static",
    "argwhere",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
    "_local_scalar_dense",
    "item",
}
# torch.tensor(host data): a pageable host-to-device copy on a GPU (a 0-dim one is how a Python
# scalar enters an op, `buf[i] = 0`: a fill, no copy).
FROM_HOST = {"lift_fresh", "lift_fresh_copy"}


class HostSyncError(AssertionError):
    def __init__(self, what: str):
        # Where in dpserve (the innermost frame of the engine's code, not of torch or Triton).
        frames = [f for f in traceback.extract_stack() if "/dpserve/" in f.filename]
        where = f"{frames[-1].filename.split('/dpserve/')[-1]}:{frames[-1].lineno}" if frames else "?"
        super().__init__(f"{what} at dpserve/{where}")


class ForbidHostSyncs(TorchDispatchMode):
    """Raises on any op inside it that reads a device value back or copies host data in."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING:
            raise HostSyncError(f"aten.{name} in a captured step")
        if name in FROM_HOST and args[0].dim() > 0:
            raise HostSyncError(f"aten.{name} (a tensor of host data) in a captured step")
        tensor_repeats = len(args) > 1 and isinstance(args[1], torch.Tensor) or func._overloadname == "Tensor"
        if name == "repeat_interleave" and tensor_repeats and "output_size" not in kwargs:
            raise HostSyncError("repeat_interleave with tensor repeats and no output_size")
        if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            raise HostSyncError(f"aten.{name} with a bool mask (a nonzero inside)")
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device", src.device)
            if src.device.type == "cpu" and torch.device(dst).type != "cpu" and not src.is_pinned():
                raise HostSyncError(f"aten.{name} from pageable host memory")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_syncs():
    """The dispatch mode, plus the Tensor methods that read values without dispatching on the CPU."""
    patched = {}

    def refuse(name):
        def method(self, *a, **k):
            raise HostSyncError(f"Tensor.{name}() in a captured step")

        return method

    for name in ("tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        patched[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, refuse(name))
    try:
        with ForbidHostSyncs():
            yield
    finally:
        for name, method in patched.items():
            setattr(torch.Tensor, name, method)


def _fused_routed(self, x, weights, ids):
    from dpserve.layers.fused_moe import fused_experts

    return fused_experts(x, self.w13, self.w2, weights, ids)


def _batch(dp_rank: int, kind: str, idle_group: int | None) -> GroupBatch:
    """Three requests decoding at contexts 5, 17 and 2 (verify: each with two drafts), on table
    rows 1..3 and fresh slots; the idle group's batch is empty."""
    if dp_rank == idle_group:
        return GroupBatch()
    n = 3 if kind == "verify" else 1
    batch, used = GroupBatch(BatchKind(kind)), 1
    for row, start in enumerate((5, 17, 2), start=1):
        slots = list(range(used, used + n))
        batch.reqs.append(BatchReq(row, start, [7] * n, slots, sample=True, verify=kind == "verify"))
        used += n
    return batch


def _check_runner(cfg: EngineConfig, rank: int, groups) -> list[str]:
    """Runs every padded step of `cfg` under the check; returns what it found (empty: sync-free)."""
    model_cfg = ModelConfig.load(cfg.model_path)
    runner = ModelRunner(cfg, model_cfg, groups, torch.device("cpu"))
    found = []
    for mode in ("sum_len", "max_len"):
        runner.policy.dp_padding_mode = mode
        for kind in ("decode", "verify"):
            # 1: the second group idles (its empty batch is the same in decode and verify steps)
            idles = (None, 1) if groups.topo.dp_size > 1 and kind == "decode" else (None,)
            for idle_group in idles:
                batch = _batch(groups.topo.dp_rank, kind, idle_group)
                sizes = exchange(batch.sizes(runner.policy.can_pad(batch)), groups)
                layout = runner.policy.step_layout(sizes)
                assert layout.padded and layout.padding_mode == mode, layout
                inputs = runner._inputs(batch, layout)  # host work, before a graph's replay
                try:
                    with forbid_host_syncs():
                        runner.forward_hidden(inputs, runner.pool)
                except HostSyncError as e:
                    found.append(f"{mode} {kind}: {e}")
                    break  # the ranks must stay in step: the others raise at the same op
    return found


def _rank(rank: int, world: int, port: int, model_path: str, variants: list[dict], results) -> None:
    torch.set_num_threads(1)
    mlp.MoE._routed = _fused_routed  # the GPU's MoE kernels
    try:
        base = dict(model_path=model_path, device="cpu", dtype="float32", attention_backend="triton")
        base |= dict(max_total_tokens=256, cuda_graph_bs=[4, 32], random_seed=0)
        base |= dict(tp_size=world, dp_size=world, enable_dp_attention=world > 1)
        cfg = EngineConfig(**base)
        groups = init_groups(cfg.rank_topology(rank)[1], "cpu", f"127.0.0.1:{port}", 120)
        for variant in variants:
            results[(rank, str(variant))] = _check_runner(EngineConfig(**base | variant), rank, groups)
    except Exception:
        results[(rank, "error")] = traceback.format_exc()
    finally:  # gloo's threads stopped before the interpreter exits (not in its static destructors)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# A variant's "arch" runs that tiny model in place of DeepSeek-V2 (V3.2: its indexer and sparse MLA,
# the contexts past its index_topk of 8).
LAYOUTS = [
    (1, [{"arch": "deepseek_v32"}]),  # V3.2's sparse path; V2's step runs at tp 2 below
    (
        2,
        [
            {},
            dict(ep_size=2, moe_a2a_backend="all_to_all"),  # EP's dispatch (none's is TP MoE's gather)
        ],
    ),
]


@pytest.mark.parametrize("world,variants", LAYOUTS, ids=["tp1", "tp2_dp2"])
def test_captured_steps_are_sync_free(model_dirs, world, variants):
    with mp.Manager() as manager:
        results = manager.dict()
        variants = [
            {k: v for k, v in variant.items() if k != "arch"}
            | ({"model_path": model_dirs[variant["arch"]]} if "arch" in variant else {})
            for variant in variants
        ]
        args = (world, free_port(), model_dirs["deepseek_v2"], variants, results)
        mp.start_processes(_rank, args=args, nprocs=world, start_method="spawn")
        results = dict(results)
    errors = {k: v for k, v in results.items() if k[1] == "error"}
    assert not errors, "\n".join(errors.values())
    assert len(results) == world * len(variants)
    found = {k: v for k, v in results.items() if v}
    assert not found, found
