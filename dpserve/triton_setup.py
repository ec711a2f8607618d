"""Triton, imported once for every kernel module. `dpserve/__init__.py` has already chosen the
interpreter (TRITON_INTERPRET=1) where there is no GPU."""

import os

import triton
import triton.language as tl

# True where kernels run in the interpreter (on the CPU): block sizes and defaults may differ.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

__all__ = ["INTERPRET", "triton", "tl"]
