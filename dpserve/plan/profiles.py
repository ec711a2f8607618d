"""Hardware profiles: published GPU figures, and a CPU profile measured on the machine the planner runs on.

GPU figures are the vendors' datasheet numbers (SXM parts; dense bf16 tensor-core FLOPs without
sparsity; NVLink bandwidth per GPU and direction; one 400 Gb/s (A100: 200 Gb/s) NIC per GPU).
Memory is what `nvidia-smi` reports as the total of one device. Achievable fractions of the peaks
and the fixed costs are the planner's assumptions, listed in `GPU_ASSUMPTIONS` and in docs/tuning.md.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

MiB = 2**20
# A cached cpu profile older than this is measured again: the machine's load, BIOS and kernel drift.
MAX_AGE = timedelta(days=7)


@dataclass
class DeviceProfile:
    name: str
    device: str  # "cuda" or "cpu": what the engine would run on (sets dtype "auto" and the KV budget)
    memory_bytes: int  # one device's total memory (CPU: not used, the budget is --kv-cache-memory-gb)
    mem_bw: float  # bytes/s one device reads from its memory (peak)
    flops: float  # dense FLOP/s of one device at the serving dtype (peak)
    intra_bw: float  # bytes/s per device and direction inside a node (NVLink; CPU: gloo, measured)
    intra_alpha: float  # seconds of latency per collective inside a node
    inter_bw: float  # bytes/s per device across nodes
    inter_alpha: float  # seconds of latency per collective across nodes
    gpus_per_node: int = 8
    mem_eff: float = 0.75  # achievable fraction of mem_bw in decode kernels
    flop_eff: float = 0.6  # achievable fraction of flops in GEMMs
    layer_overhead: float = 60e-6  # fixed seconds per decoder layer (kernel launches inside a graph)
    step_overhead: float = 1.5e-3  # fixed seconds per step (host: batch tensors, sampling, bookkeeping)
    op_overhead: float = 0.0  # CPU: seconds of one eager op's dispatch
    cores: int = 0  # CPU: cores the ranks share
    source: str = ""
    measured: dict = field(default_factory=dict)  # CPU: the raw measurements
    # CPU: measured_at (ISO, UTC), load (1-minute load average then), cores, torch, cpu_model
    provenance: dict = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"


GB = 1e9
GPU_ASSUMPTIONS = (
    "achievable: 75% of memory bandwidth, 60% of dense bf16 FLOPs; NCCL: 10 us per collective inside "
    "a node, 25 us across nodes, 70% of link bandwidth; 60 us of kernel launches per layer inside a "
    "CUDA graph; 1.5 ms of host work per step, counted whole (overlap scheduling puts most of it beside "
    "the forward; unmeasured on a GPU so far); an "
    "unpadded all_to_all step waits 50 us per MoE layer for the exchanged counts on the host"
)


def _gpu(name, mem_mib, bw_tbs, tflops, nvlink_gbs, nic_gbs, source) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        device="cuda",
        memory_bytes=mem_mib * MiB,
        mem_bw=bw_tbs * 1e12,
        flops=tflops * 1e12,
        intra_bw=0.7 * nvlink_gbs * GB,
        intra_alpha=10e-6,
        inter_bw=0.7 * nic_gbs * GB,
        inter_alpha=25e-6,
        source=source,
    )


GPU_PROFILES = {
    "h100": _gpu(
        "h100", 81559, 3.35, 989, 450, 50, "H100 SXM 80GB: 3.35 TB/s HBM3, 989 TFLOPS bf16, NVLink4"
    ),
    "h200": _gpu(
        "h200", 143771, 4.8, 989, 450, 50, "H200 SXM 141GB: 4.8 TB/s HBM3e, 989 TFLOPS bf16, NVLink4"
    ),
    "a100-80g": _gpu(
        "a100-80g", 81920, 2.039, 312, 300, 25, "A100 SXM 80GB: 2.04 TB/s HBM2e, 312 TFLOPS bf16, NVLink3"
    ),
    "b200": _gpu("b200", 183359, 8.0, 2250, 900, 50, "B200 180GB: 8 TB/s HBM3e, 2.25 PFLOPS bf16, NVLink5"),
}
PROFILES = (*GPU_PROFILES, "cpu")


def cpu_profile_path() -> Path:
    from dpserve.cache import cache_root

    return cache_root() / "cpu_profile.json"


def get_profile(name: str, remeasure: bool = False) -> DeviceProfile:
    """A GPU profile, or the cpu profile: the cached one unless `remeasure` or it is stale (see
    `stale_reason`), else measured now and cached."""
    if name in GPU_PROFILES:
        return GPU_PROFILES[name]
    if name != "cpu":
        raise ValueError(f"unknown device profile {name!r}; one of {', '.join(PROFILES)}")
    path = cpu_profile_path()
    if path.exists() and not remeasure:
        try:
            profile = DeviceProfile(**json.loads(path.read_text()))
            why = stale_reason(profile.provenance)
        except (ValueError, TypeError):  # unreadable, or written by another version of this class
            why = "the cache is unreadable"
        if why is None:
            return profile
        print(f"measuring the cpu profile again: {why}", file=sys.stderr)
    load = os.getloadavg()[0]  # before measuring, which loads the machine itself
    when = datetime.now(timezone.utc)
    profile = measure_cpu()
    profile.provenance = {
        "measured_at": when.isoformat(timespec="seconds"),
        "load": round(load, 2),
        **this_machine(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile), indent=1))
    return profile


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def this_machine() -> dict:
    """What a cpu profile depends on besides the load: another value means another machine."""
    import torch

    return {"cores": os.cpu_count(), "torch": torch.__version__, "cpu_model": _cpu_model()}


def stale_reason(provenance: dict) -> str | None:
    """Why a cached cpu profile must be measured again, or None when it can be used."""
    if "measured_at" not in provenance:
        return "the cache does not say when it was measured"
    for key, value in this_machine().items():
        if provenance.get(key) != value:
            return f"it was measured with {key} {provenance.get(key)!r}, this machine has {value!r}"
    age = datetime.now(timezone.utc) - datetime.fromisoformat(provenance["measured_at"])
    if age > MAX_AGE:
        return f"it is {age.days} days old (more than {MAX_AGE.days})"
    return None


def provenance_lines(profile: DeviceProfile) -> list[str]:
    """Where a measured profile comes from, and a warning when it was measured on a busy machine."""
    p = profile.provenance
    if not p:
        return []
    when = datetime.fromisoformat(p["measured_at"]).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"cpu profile measured {when}, load {p['load']:.1f} on {p['cores']} cores; "
        "--remeasure to measure again"
    ]
    if p["load"] > p["cores"] / 2:
        lines.append(
            f"warning: the machine was busy when the cpu profile was measured (load {p['load']:.1f} > half "
            "its cores): predicted step times may be too long; --remeasure on a quiet machine"
        )
    return lines


def _median_time(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cpu() -> DeviceProfile:
    """Matmul throughput, memory bandwidth and op dispatch on this machine, and gloo collectives."""
    import torch

    cores = os.cpu_count() or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(cores)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _median_time(lambda: a @ b)
    big = torch.empty(64 * MiB // 4)
    dst = torch.empty_like(big)
    mem_bw = 2 * big.numel() * 4 / _median_time(lambda: dst.copy_(big))
    # Dispatch of a small op at each thread count a rank may get (the engine gives each rank
    # cores // ranks threads): with several threads a tiny op mostly waits for the pool's wake-up.
    x = torch.randn(4, 64)
    w = torch.randn(64, 64)

    def ops():
        for _ in range(200):
            torch.nn.functional.linear(x, w)
            x.add(1.0)

    op_by_threads = {}
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        op_by_threads[threads] = _median_time(ops, reps=15) / 400
    torch.set_num_threads(previous)
    op = op_by_threads[1]
    gloo = measure_gloo(2)
    gloo_by_world = {str(w): measure_gloo(w) for w in (2, 4)}
    alpha = gloo["alpha"]
    return DeviceProfile(
        name="cpu",
        device="cpu",
        memory_bytes=0,
        mem_bw=mem_bw,
        flops=flops,
        intra_bw=gloo["bw"],
        intra_alpha=alpha,
        inter_bw=gloo["bw"],
        inter_alpha=alpha,
        gpus_per_node=cores,
        mem_eff=1.0,
        flop_eff=1.0,
        layer_overhead=0.0,
        step_overhead=0.0,
        op_overhead=op,
        cores=cores,
        source=f"measured on this machine ({cores} cores)",
        measured={
            "matmul_flops": flops,
            "copy_bw": mem_bw,
            "op_s": op,
            "op_s_by_threads": {str(k): v for k, v in op_by_threads.items()},
            "gloo": gloo,
            "gloo_by_world": gloo_by_world,
        },
    )


def _gloo_worker(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for name, numel in (("small", 64), ("large", 4 * MiB // 4)):
        t = torch.zeros(numel)
        for _ in range(3):
            dist.all_reduce(t)
        reps = 30 if name == "small" else 8
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        out[name] = (time.perf_counter() - start) / reps
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_gloo(world: int = 2) -> dict:
    """All-reduce latency (64 floats) and bus bandwidth (4 MiB) of gloo over `world` local processes:
    alpha from the small message (per ring step), beta from the large one."""
    import multiprocessing as mp

    from dpserve.engine.worker_pool import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = queue.get(timeout=120)
    for p in procs:
        p.join()
    steps = 2 * (world - 1)
    alpha = out["small"] / steps
    bus_bytes = steps / world * 4 * MiB
    bw = bus_bytes / max(out["large"] - steps * alpha, 1e-9)
    return {
        "world": world,
        "allreduce_small_s": out["small"],
        "allreduce_4MiB_s": out["large"],
        "alpha": alpha,
        "bw": bw,
    }
