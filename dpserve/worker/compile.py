"""torch.compile of padded decode steps (`--enable-torch-compile`, `--torch-compile-max-bs`).

What is compiled: `DecoderLayer.forward`, one function for every layer. Dynamo inlines the
nn.Modules and takes their parameters as graph inputs, so all layers of a kind (dense MLP, MoE)
share the graphs of a padded layout, and weights and the KV pool are read in place, never copied
(no freezing). Shapes are static per layout (its bucket and mode are constants of the graphs): the
warm-up compiles each (mode, bucket) once per layer kind, and serving compiles nothing
(tests/test_compile.py checks it under `fail_on_recompile`).

Where the graphs break: each attention module's `attend` (the KV write and attention over the pool)
runs eagerly between two compiled regions of the layer's frame (Dynamo's nested graph breaks): the
pool is indexed by the layer, which would specialize every layer's graph, and the KV length changes
every step. The collectives of dp_comm.py are traced as functional collectives (gloo on the CPU,
NCCL on the GPU) in program order: sum_len's all-reduces and max_len's reduce-scatter and all-gather
are tested; ep_dispatch.py's fixed-capacity all_to_all is not yet. Where a graph breaks for another
reason (the CPU MoE's data-dependent expert loop) the code around it runs eagerly as written. Every
rank compiles the same regions in the same order: the warm-up runs the same padded layouts on
every rank, each a step every rank takes part in.

What runs eagerly: unpadded steps (extend/prefill, decode past the buckets or too long for one),
buckets above `torch_compile_max_bs`. On the GPU the compiled steps are then captured as CUDA
graphs (the capture's warm-up finds them compiled).

Inductor's FX graph cache keeps the compiled kernels between starts, in `$TORCHINDUCTOR_CACHE_DIR`
(default here: `$DPSERVE_CACHE/inductor`, i.e. `~/.cache/dpserve/inductor`, which survives
reboots unlike inductor's own default under /tmp): a second start skips the C++/Triton builds
(Dynamo still traces, and the ranks still load the kernels).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from dpserve.cache import cache_root
from dpserve.kvcache.pool import KVPool
from dpserve.models.base import CausalLM, DecoderLayer
from dpserve.models.batch import ForwardBatch
from dpserve.step.records import StepLayout

logger = logging.getLogger(__name__)

LAYER_KINDS = 2  # dense MLP and MoE layers trace differently: one graph each per layout


def inductor_cache_dir() -> str:
    """Where inductor caches compiled graphs: `$TORCHINDUCTOR_CACHE_DIR` as the user set it, else
    dpserve's cache (every rank derives the same)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # imports Dynamo: 1.6 s

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Inductor writes its default into the variable on first use (importing transformers does).
    if current is None or current == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = current = str(cache_root() / "inductor")
    return current


class CompiledDecode:
    def __init__(self, model: CausalLM, layouts: list[StepLayout], max_bs: int):
        """Compiles nothing yet: `warm_up` does, for the `layouts` whose bucket is at most `max_bs`."""
        self.model = model
        self.cache_dir = inductor_cache_dir()
        self.layouts = [layout for layout in layouts if layout.bucket <= max_bs]
        self.keys = {(layout.padding_mode, layout.bucket) for layout in self.layouts}
        # Dynamo keeps one entry per guard set of a code object; past its limit it would silently run
        # eagerly. The frames split off at graph breaks count alike.
        limit = LAYER_KINDS * len(self.layouts) + 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        # A break inside the attention module (its `attend`) resumes in the layer's own graph: two
        # graphs per layer kind and layout, not four (measured: half the compile time on the CPU).
        torch._dynamo.config.nested_graph_breaks = True
        self.run_layer = torch.compile(DecoderLayer.forward, dynamic=False)
        # The graph break: every attention module's `attend` runs eagerly. Done here, not with a
        # decorator, because `torch.compiler.disable` imports Dynamo (1.6 s per rank) at import.
        for module in model.modules():
            if callable(getattr(module, "attend", None)):
                module.attend = torch.compiler.disable(module.attend)

    def covers(self, layout: StepLayout) -> bool:
        return (layout.padding_mode, layout.bucket) in self.keys

    def forward_hidden(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """The model's `forward_hidden`, its layers compiled when the batch's layout is covered."""
        return self.model.forward_hidden(batch, pool, self.run_layer if self.covers(batch.layout) else None)

    def warm_up(self, run_step: Callable[[StepLayout], Callable[[], object]]) -> None:
        """Compiles every covered layout by running it once (`run_step(layout)` prepares a step with
        no real rows and returns the call that runs it); every rank must call it together."""
        start = time.perf_counter()
        show = self.model.groups.topo.rank == 0
        bar = tqdm(self.layouts, desc="Compiling decode steps", unit="bucket", disable=not show)
        bar.set_postfix_str(f"inductor cache {self.cache_dir}")
        for layout in bar:
            run_step(layout)()
        logger.info(
            "torch.compile: %d padded decode layouts (buckets %s) compiled in %.1f s; inductor cache %s",
            len(self.layouts),
            sorted({layout.bucket for layout in self.layouts}),
            time.perf_counter() - start,
            self.cache_dir,
        )
