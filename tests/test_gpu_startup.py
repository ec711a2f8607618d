"""Start-up traps of a GPU run, checked on the CPU: the fork server's preload must not initialise
CUDA (every forked rank would then fail with "initialization error"), and more ranks per node than
visible GPUs is a configuration error naming the numbers, not a later NCCL error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dpserve.config import EngineConfig
from dpserve.engine.worker_pool import FORKSERVER_PRELOAD, prepared

# Records every torch.cuda entry point that initialises CUDA or queries the driver, then imports
# what the fork server preloads (worker_pool: set_forkserver_preload).
PROBE = """
import torch, torch.cuda
called = []
def spy(name, f):
    def wrapper(*a, **k):
        called.append(name)
        return f(*a, **k)
    return wrapper
for name in ("_cuda_init", "_cuda_getDeviceCount"):  # absent from CPU builds
    if hasattr(torch._C, name):
        setattr(torch._C, name, spy("torch._C." + name, getattr(torch._C, name)))
for name in ("_lazy_init", "init", "is_available", "device_count", "current_device", "set_device",
             "get_device_properties", "mem_get_info", "synchronize", "graph_pool_handle"):
    setattr(torch.cuda, name, spy("torch.cuda." + name, getattr(torch.cuda, name)))
import importlib
for module in PRELOAD:
    importlib.import_module(module)
print(sorted(set(called)))
"""


def test_fork_server_preload_leaves_cuda_untouched():
    out = subprocess.run(
        [sys.executable, "-c", f"PRELOAD = {FORKSERVER_PRELOAD!r}\n" + PROBE],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_more_ranks_per_node_than_gpus_is_refused(model_dirs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = EngineConfig(
        model_path=model_dirs["deepseek_v2"], device="cuda", tp_size=4, dp_size=2, enable_dp_attention=True
    )
    with pytest.raises(ValueError, match=r"4 ranks per node .* need 4 GPUs per node, but this node sees 2"):
        prepared(cfg)
    two_nodes = EngineConfig(
        model_path=model_dirs["deepseek_v2"], device="cuda", tp_size=4, nnodes=2, dist_init_addr="127.0.0.1:1"
    )
    assert prepared(two_nodes).ranks_per_node == 2
