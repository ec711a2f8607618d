"""What only a GPU can check, as staged checks (scripts/gpu_stages.py), each in its own process under
its own timeout, printing `PASS|FAIL|SKIP name: figures` the moment it ends and a summary line last.
Exit status 1 iff a stage failed. Without a GPU every stage is skipped (exit 0, in seconds);
`--device cpu` runs the stages' CPU variants at tiny shapes (Triton's interpreter, gloo), as the
test suite does.

    bash scripts/gpu_check.sh                        # on the GPU machine: under 5 minutes on one GPU
    python scripts/gpu_check.py --device cpu         # the CPU variants
    python scripts/gpu_check.py --stages kernels graphs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = "GPU_CHECK_RESULT "  # the stage process's last line: RESULT {"status": ..., "figures": ...}
CPU_TIMEOUT_FACTOR = 4  # two CPU cores, interpreted kernels, gloo


def stage_main(name: str, device: str) -> None:
    """Run one stage in this process and print its result line."""
    sys.path.insert(0, str(HERE))
    import gpu_stages

    stage = next(s for s in gpu_stages.STAGES if s.name == name)
    scale = gpu_stages.GPU if device == "cuda" else gpu_stages.CPU
    try:
        result = {"status": "PASS", "figures": stage.run(scale)}
    except gpu_stages.StageFailed as e:
        result = {"status": "FAIL", "figures": str(e)}
    except Exception as e:  # any crash is this stage's failure; the next stages still run
        import traceback

        traceback.print_exc()
        result = {"status": "FAIL", "figures": f"{type(e).__name__}: {e}"}
    print(RESULT + json.dumps(result), flush=True)


def run_stage(name: str, device: str, timeout_s: float) -> tuple[str, str]:
    """The stage in a child process: its output passes through as it comes, its verdict comes last."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device == "cpu" and name == "kernels":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-stage", name, "--device", device]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    verdict = ("FAIL", "no result line (crashed)")
    deadline = time.monotonic() + timeout_s
    import threading

    def read() -> None:
        nonlocal verdict
        for line in proc.stdout:
            if line.startswith(RESULT):
                r = json.loads(line[len(RESULT) :])
                verdict = (r["status"], r["figures"])
            else:
                print(f"  | {line}", end="", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(5)
        return "FAIL", f"timed out after {timeout_s:.0f} s"
    reader.join(5)
    if proc.returncode and verdict[0] == "PASS":
        return "FAIL", f"exit status {proc.returncode} after passing"
    return verdict


def gpu_count() -> int:
    try:  # NVML's count: no CUDA context in this process, so the stages get the whole GPU
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def main() -> None:
    sys.path.insert(0, str(HERE))
    from gpu_stages import STAGES

    names = [s.name for s in STAGES]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda if present")
    p.add_argument("--stages", nargs="+", choices=names, default=names, help="stages to run, in order")
    p.add_argument("--run-stage", choices=names, help=argparse.SUPPRESS)  # internal: one stage, here
    args = p.parse_args()
    if args.run_stage:
        stage_main(args.run_stage, args.device)
        return
    gpus = gpu_count()
    device = args.device if args.device != "auto" else ("cuda" if gpus else "none")
    start = time.monotonic()
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    failed = []
    for stage in (s for s in STAGES if s.name in args.stages):
        if device == "none":
            status, figures = "SKIP", "no CUDA device here (--device cpu runs the CPU variants)"
        elif device == "cuda" and gpus < stage.gpus:
            status, figures = "SKIP", f"needs {stage.gpus} GPUs (one NCCL rank each), this machine has {gpus}"
        else:
            print(f"---- {stage.name}: {stage.run.__doc__.split(chr(10))[0]}", flush=True)
            factor = CPU_TIMEOUT_FACTOR if device == "cpu" else 1
            t0 = time.monotonic()
            status, figures = run_stage(stage.name, device, stage.timeout_s * factor)
            figures = f"{figures} ({time.monotonic() - t0:.0f} s)"
        counts[status] += 1
        if status == "FAIL":
            failed.append(stage.name)
        print(f"{status} {stage.name}: {figures}", flush=True)
    summary = ", ".join(f"{n} {s.lower()}ed" if s != "SKIP" else f"{n} skipped" for s, n in counts.items())
    tail = f" ({', '.join(failed)})" if failed else ""
    print(f"GPU CHECK {'FAIL' if failed else 'PASS'}: {summary}{tail} in {time.monotonic() - start:.0f} s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
