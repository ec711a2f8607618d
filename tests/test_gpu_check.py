"""scripts/gpu_check.sh cannot rot between GPU runs: every stage's CPU variant (tiny shapes, Triton's
interpreter, gloo) passes here but those whose CPU variants other tests already run (each stage's
code is the shared `compare`, `run` and bench functions the others use): compile's
(tests/test_compile.py), serving's (tests/test_bench_serving.py), padding's (tests/test_padding.py),
nextn's (tests/test_nextn.py), tp2_dp2's (tests/test_parity.py) and expert_parallel's
(tests/test_ep.py); and without a GPU the script skips every stage, saying why, and exits 0 in
seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_stages import STAGES  # noqa: E402


def gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def verdicts(output: str) -> dict[str, str]:
    """Each stage's verdict line: `PASS|FAIL|SKIP name: figures`."""
    return {name: status for status, name in re.findall(r"^(PASS|FAIL|SKIP) (\w+): ", output, re.M)}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU runs the stages themselves")
def test_without_a_gpu_every_stage_is_skipped_in_seconds():
    run = gpu_check(timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert verdicts(run.stdout) == {s.name: "SKIP" for s in STAGES}
    assert "no CUDA device here" in run.stdout
    assert re.search(
        rf"^GPU CHECK PASS: 0 passed, 0 failed, {len(STAGES)} skipped in \d+ s$", run.stdout, re.M
    )


def test_every_stage_passes_its_cpu_variant(engine_cache):
    engine_cache.close()  # two cores: the stages start their own engines
    # Left to the tests that run the same on the CPU: padded steps against eager in every mode
    # (graphs: test_padding), compile, serving, padding, nextn, tp2_dp2, expert_parallel.
    covered = ("graphs", "compile", "serving", "padding", "nextn", "tp2_dp2", "expert_parallel")
    stages = [s.name for s in STAGES if s.name not in covered]
    run = gpu_check("--device", "cpu", "--stages", *stages, timeout=540)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert verdicts(run.stdout) == dict.fromkeys(stages, "PASS"), run.stdout[-6000:]
    assert f"GPU CHECK PASS: {len(stages)} passed, 0 failed, 0 skipped" in run.stdout


def test_the_8_bit_weight_kernels_compile_for_a100_and_h100():
    """scripts/compile_kernels.py: the Triton GEMM and fused MoE kernels with block-FP8 (weight-only)
    and int8 weights, as the kernels stage launches them in bfloat16, compiled to cubins for sm80
    (no FP8 conversions) and sm90 by Triton's own compiler, no GPU needed; with FP8 dots for sm90
    alone (the script compiles every kernel of the stage when asked for all; docs/benchmarks.md has
    that run)."""
    kernels = ("_linear_kernel", "_gate_up_kernel", "_down_kernel")
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "compile_kernels.py"),
            "--arch",
            "80",
            "90",
            "--only",
            *kernels,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    compiled = re.findall(r"^ok   (\w+) \(.*WFORMAT=(\d).*\) for (.*)$", run.stdout, re.M)
    want = {(k, f, "sm80 sm90") for k in kernels for f in "12"} | {(k, "3", "sm90") for k in kernels}
    assert want <= set(compiled), run.stdout
    assert re.search(r"^COMPILED \d+ kernels for sm80 sm90, 0 failed$", run.stdout, re.M)
