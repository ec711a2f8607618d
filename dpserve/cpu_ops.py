"""Fused CPU kernels (dpserve/csrc/cpu_ops.cpp), built on first use with the machine's C++ compiler
and cached with dpserve's other build products; `torch.ops.dpserve_cpu.*` once `load()` succeeds.

A decode step on the CPU is a few hundred ATen calls per layer whose fixed cost, not their
arithmetic, dominates: these kernels fuse the chains that cost most (docs/benchmarks.md, "Fused CPU
kernels"). Where no compiler is found, or `DPSERVE_CPU_KERNELS=0`, the model runs the same math in
plain PyTorch, and says so once. Also here: oneDNN's prepacked GEMM (`pack`, `packed_linear`), which
the layers and the dtype probe share.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from dpserve.cache import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# Built where it runs (the machine's own vector units); products rounded as written, never fused.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def load() -> bool:
    """Builds (first time on this machine) and loads the kernels; False, after saying why, where
    they cannot be."""
    if os.environ.get("DPSERVE_CPU_KERNELS", "1") == "0":
        logger.info("fused CPU kernels off (DPSERVE_CPU_KERNELS=0): decode steps run in plain PyTorch")
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning(
            "no C++ compiler (c++ or $CXX): the fused CPU kernels are off, decode steps are slower"
        )
        return False
    from torch.utils.cpp_extension import load as build

    # One build per torch version and CPU (model and instruction sets): -march=native code runs only
    # where it was built.
    directory = cache_root() / "cpu_ops" / f"torch{torch.__version__}-{cpu_key()}"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        build(
            name="dpserve_cpu_ops",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )
    except (RuntimeError, OSError, ImportError) as e:  # a compiler that fails, no ninja
        logger.warning("fused CPU kernels could not be built (%s): decode steps run in plain PyTorch", e)
        return False
    logger.info("fused CPU kernels loaded from %s", directory)
    return True


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels run on `x`: a CPU tensor outside torch.compile's tracing (inductor fuses
    the plain form there itself) on a machine where they are built."""
    return x.is_cpu and not torch.compiler.is_compiling() and load()


def cpu_key() -> str:
    """This CPU's model name and instruction sets, hashed: what code built or measured here depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first = {k.strip(): v for k, _, v in (line.partition(":") for line in lines) if k.strip() in KEYS}
    return hashlib.sha256(repr(sorted(first.items())).encode()).hexdigest()[:12]


KEYS = ("model name", "flags")


# oneDNN's prepacked GEMM (`Linear.pack_for_cpu`): weights reordered once into its blocked layout.


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on a weight `pack` reordered: the same bits."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_packs(dtype: torch.dtype, device_type: str) -> bool:
    """Whether oneDNN runs a prepacked weight of this dtype here: bfloat16 on a CPU with native support."""
    return device_type == "cpu" and dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
