"""dpserve: a compact LLM serving engine with DP attention for DeepSeek-style MoE models."""

import os

import torch

# Without a GPU, Triton kernels run in its interpreter, so the CPU checks the code the GPU runs.
# Set before anything imports triton (transformers does, through torch._dynamo).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dpserve.engine.engine import Engine  # noqa: E402

__all__ = ["Engine"]
