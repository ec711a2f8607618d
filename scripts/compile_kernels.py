"""Compiles every Triton kernel that the GPU check's kernels stage launches (attention in every
form, the V3.2 indexer, the fused MoE, the 8-bit weight GEMMs) for real GPUs, on a machine without
one: Triton's compiler and ptxas ship in its wheel, so a kernel that the interpreter runs but the
compiler refuses (a dot too small for int8, a type that differs between branches) fails here
rather than on the first lent GPU.

    python scripts/compile_kernels.py                 # sm80 (A100: no FP8) and sm90 (H100, H200)
    python scripts/compile_kernels.py --arch 90

The stage runs at its CPU variant's shapes in the GPU's dtype (bfloat16). Each launch is compiled
instead of run (the stage's outputs are then garbage and its
verdict is ignored), once per distinct kernel, argument types and constexprs. Prints one line per
compiled kernel and `COMPILED n kernels for sm80 sm90, k failed`; exit status 1 iff one failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # the real JIT, whatever dpserve would choose here

import torch  # noqa: E402

TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(argument types, constexprs, launch options) of one launch, as Triton types them."""
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    types, constexprs = {}, {}
    for name, value in bound.arguments.items():
        if name in constexpr_names:
            types[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            types[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            types[name] = "fp32"
        elif value is None:
            types[name], constexprs[name] = "constexpr", None
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} of type {type(value).__name__}")
    return types, constexprs, options


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (80: A100)"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="KERNEL", help="compile only these kernels (function names)"
    )
    args = parser.parse_args()
    torch.cuda.is_available = lambda: True  # dpserve's Triton modules refuse to load without a GPU
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    seen: set[str] = set()
    failed: list[str] = []

    def compile_instead(self, *a, grid, warmup, **kwargs):
        types, constexprs, options = signature(self, a, dict(kwargs))
        key = repr((self.fn.__qualname__, sorted(types.items()), sorted(map(repr, constexprs.items()))))
        if key in seen or (args.only and self.fn.__name__ not in args.only):
            return None
        seen.add(key)
        shown = ", ".join(f"{k}={v}" for k, v in constexprs.items() if v is not None)
        # FP8 dots (the 8-bit kernels' WFORMAT 3) exist from sm89; older GPUs take the weight-only form.
        archs = [a for a in args.arch if a >= 89 or constexprs.get("WFORMAT") != 3]
        for arch in archs:
            try:
                src = ASTSource(self, types, constexprs)
                triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            except Exception as e:
                failed.append(f"{self.fn.__name__} sm{arch} ({shown}): {type(e).__name__}: {e}")
                print(f"FAIL {failed[-1]}", flush=True)
                return None
        print(f"ok   {self.fn.__name__} ({shown}) for {' '.join(f'sm{a}' for a in archs)}", flush=True)
        return None

    JITFunction.run = compile_instead
    from dpserve.attention import triton_kernels

    triton_kernels._device_sms = lambda: 132  # an H100's: the GPU's launch choices, no device asked
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_stages

    try:  # the CPU variant's small shapes in the GPU's dtype: serving's kernels, compiled quickly
        gpu_stages.kernels(dataclasses.replace(gpu_stages.CPU, kernel_dtype=gpu_stages.GPU.kernel_dtype))
    except gpu_stages.StageFailed:
        pass  # the outputs were never computed
    except Exception:
        traceback.print_exc()
        failed.append("the kernels stage crashed before its last launch")
    archs = " ".join(f"sm{a}" for a in args.arch)
    print(f"COMPILED {len(seen)} kernels for {archs}, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
