"""Triton, imported once for every kernel module. `dpserve/__init__.py` has already chosen the
interpreter (TRITON_INTERPRET=1) where there is no GPU."""

import triton
import triton.language as tl

__all__ = ["triton", "tl"]
