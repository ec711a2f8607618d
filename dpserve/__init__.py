"""dpserve: a compact LLM serving engine with DP attention for DeepSeek-style MoE models.

`from dpserve import Engine` loads the engine's modules on first use, so importing the package
(for the CLI's --help, the planner, the benchmarks' clients) stays cheap.
"""

import os

# Without a GPU (no NVIDIA driver, or none visible), Triton kernels run in its interpreter, so the
# CPU checks the code the GPU runs. Triton reads the flag when it is first imported (transformers
# imports it, through torch._dynamo), so it is set here, without importing torch.
if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") or not os.path.isdir("/proc/driver/nvidia/gpus"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from dpserve.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'dpserve' has no attribute {name!r}")
