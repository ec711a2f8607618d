"""Triton, imported once for every kernel module. `dpserve/__init__.py` has already chosen the
interpreter (TRITON_INTERPRET=1) where there is no GPU."""

import os

import torch
import triton
import triton.language as tl

# True where kernels run in the interpreter (on the CPU): block sizes and defaults may differ.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    raise RuntimeError(
        "Triton kernels need a GPU, and this process sees none: set TRITON_INTERPRET=1 before starting "
        "it to run them in Triton's interpreter, or use the sdpa attention backend"
    )

__all__ = ["INTERPRET", "tl", "triton"]
