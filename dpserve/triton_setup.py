"""Triton, imported once for every kernel module, with the helpers kernels of several packages share. `dpserve/__init__.py` has already chosen the
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

__all__ = ["INTERPRET", "tl", "triton", "widen_fp8"]


@triton.jit
def widen_fp8(codes, MANTISSA: tl.constexpr):
    """FP8 codes (uint8) to float32, exactly: sign, exponent and mantissa bits placed in a float32's,
    times 2^(127 - bias), subnormals included; integer ops only, so any GPU (sm80 has no FP8
    conversions) and the interpreter run it. MANTISSA: 3 for float8_e4m3fn, 2 for float8_e5m2."""
    c = codes.to(tl.uint32)
    f = (((c & 0x80) << 24) | ((c & 0x7F) << (23 - MANTISSA))).to(tl.float32, bitcast=True)
    if MANTISSA == 3:
        return f * 1.329227995784916e36  # 2^120: e4m3fn's exponent bias is 7
    else:
        return f * 5.192296858534828e33  # 2^112: e5m2's is 15
