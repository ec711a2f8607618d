"""`--dtype auto` on the CPU: bfloat16 only where this machine runs the engine's GEMMs faster in it
than in float32, measured once (about a second) and cached per CPU and torch version. Native
bfloat16 (AMX, AVX512-BF16) usually decides it, but not always at decode's few rows, and an
emulated bfloat16 is several times slower than float32."""

from __future__ import annotations

import functools
import json
import logging
import time

import torch
import torch.nn.functional as F

from dpserve.cache import cache_root
from dpserve.cpu_ops import cpu_key, onednn_packs, pack, packed_linear

logger = logging.getLogger(__name__)

# A decode step's and a prefill chunk's rows through a 2,048-wide projection.
SHAPES = ((16, 2048, 2048), (512, 2048, 2048))


def prefers_bfloat16() -> bool:
    """Whether bfloat16 GEMMs beat float32 ones here (the cached probe, or a new one)."""
    path = cache_root() / "dtype_probe.json"
    key = f"torch{torch.__version__}-{cpu_key()}"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = probe()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1) + "\n")
    times = cached[key]
    return times["bfloat16_s"] < times["float32_s"]


def probe() -> dict[str, float]:
    """Seconds for SHAPES in each dtype, each GEMM as the engine runs it (bfloat16 on oneDNN's
    prepacked weights where it packs them), the best of five runs."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        total = 0.0
        for rows, k, n in SHAPES:
            w, x = torch.randn(n, k).to(dtype), torch.randn(rows, k).to(dtype)
            packed = pack(w) if onednn_packs(dtype, "cpu") else None
            gemm = (
                functools.partial(packed_linear, x, packed)
                if packed is not None
                else functools.partial(F.linear, x, w)
            )
            gemm()
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                gemm()
                best = min(best, time.perf_counter() - start)
            total += best
        out[f"{str(dtype).removeprefix('torch.')}_s"] = total
    logger.info(
        "dtype probe: bfloat16 GEMMs %.2f ms, float32 %.2f ms (cached in %s)",
        out["bfloat16_s"] * 1e3,
        out["float32_s"] * 1e3,
        cache_root() / "dtype_probe.json",
    )
    return out
