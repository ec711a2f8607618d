"""Triton, imported once for every kernel module: without a GPU, kernels run in Triton's
interpreter (TRITON_INTERPRET=1), so the CPU checks the very code the GPU runs."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["triton", "tl"]
