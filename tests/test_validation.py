"""Invalid layouts and model shapes fail at construction, naming the numbers, before any process starts."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ARCHS

from dpserve import Engine
from dpserve.config import EngineConfig
from dpserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tp_size": 2, "dp_size": 4, "enable_dp_attention": True}, "dp_size=4 must not exceed tp_size=2"),
        (
            {"tp_size": 4, "dp_size": 3, "enable_dp_attention": True},
            "tp_size=4 must be divisible by dp_size=3",
        ),
        (
            {"tp_size": 2, "dp_size": 3, "nnodes": 4, "dist_init_addr": "127.0.0.1:5000"},
            "the 6 ranks (tp=2 x 3 instance(s)) cannot be split evenly over nnodes=4",
        ),
        ({"tp_size": 2, "nnodes": 2}, "the offline Engine runs on one node"),
        ({"nnodes": 2, "node_rank": 2}, "node_rank=2 must be in [0, nnodes=2)"),
        ({"tp_size": 0}, "tp_size must be >= 1, got 0"),
        ({"dp_padding_mode": "bogus"}, "dp_padding_mode must be one of"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs must be >= 1, got 0"),
        ({"cuda_graph_bs": [4, 0]}, "cuda_graph_bs must be >= 1, got [4, 0]"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of"),
    ],
)
def test_bad_layouts(model_dirs, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine(model_path=model_dirs["deepseek_v2"], device="cpu", **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_heads_not_divisible(model_dirs, arch):
    # The tiny models have 4 attention heads: attention TP 8 cannot split them.
    with pytest.raises(
        ValueError, match=re.escape("num_attention_heads=4 is not divisible by 8 (tp=8, dp=1")
    ):
        Engine(model_path=model_dirs[arch], tp_size=8, device="cpu")


def test_intermediate_not_divisible(model_dirs):
    # tp=6, dp=6: attention TP 1 is fine, but moe_intermediate_size=32 does not split 6 ways.
    with pytest.raises(ValueError, match=re.escape("intermediate_size=128 is not divisible by tp_size=6")):
        Engine(
            model_path=model_dirs["deepseek_v2"], tp_size=6, dp_size=6, enable_dp_attention=True, device="cpu"
        )


@pytest.mark.parametrize(
    "params,message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an int >= 1"),
        ({"temperature": -1.0}, "temperature must be a number >= 0"),
        ({"temperature": "hot"}, "temperature must be a number >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": 0}, "top_k must be -1 or an int >= 1"),
        ({"seed": "x"}, "seed must be an int or None"),
        ({"stop_token_ids": [1, "a"]}, "stop_token_ids must be a list of ints"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"min_p": 2.0}, "min_p must be in [0, 1]"),
        ({"max_tokens": 3}, "unknown sampling parameter(s): max_tokens"),
    ],
)
def test_bad_sampling_params(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams.from_dict(params)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--tp", "0"], "argument --tp/--tp-size: must be >= 1, got 0"),
        (["--tp", "4", "--dp", "3", "--enable-dp-attention"], "tp_size=4 must be divisible by dp_size=3"),
        (["--tp", "8"], "num_attention_heads=4 is not divisible by 8"),
        (["--dp-padding-mode", "bogus"], "invalid choice: 'bogus'"),
        (["--nnodes", "2", "--tp", "2"], "nnodes > 1 needs dist_init_addr"),
        (
            ["--tp", "2", "--dp", "2", "--enable-dp-attention", "--max-running-requests", "1"],
            "max_running_requests=1 is divided among the dp_size=2 DP groups (as SGLang does): give at least 2",
        ),
        (["--device", "cuda"], "device=cuda, but this process sees no CUDA device"),
        (
            ["--tp", "8", "--dp", "3"],  # replicas: the heads check names them and what would work
            "is not divisible by 8 (tp=8, 3 replicas, attention TP size 8); attention TP sizes",
        ),
    ],
)
def test_launch_server_rejects_bad_flags_and_shapes(model_dirs, flags, message):
    """The server exits non-zero at start-up, before any rank starts, naming the numbers."""
    assert launch(model_dirs["deepseek_v2"], *flags, code=2) and message in launch.stderr


def launch(model_path: str, *flags: str, code: int, timeout: float = 120) -> bool:
    """Runs launch_server until it exits; True if with `code` (its stderr: `launch.stderr`)."""
    cmd = [sys.executable, "-m", "dpserve.launch_server", "--model-path", model_path, *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    launch.stderr = result.stdout + result.stderr
    assert result.returncode == code, launch.stderr
    return True


ACCEPTED = "--model-path takes a local Hugging Face directory (config.json and *.safetensors), a .gguf file"


def test_model_paths_say_what_is_accepted(model_dirs, tmp_path):
    """A missing path, a hub id and a folder without config.json each get one sentence saying what
    --model-path takes, at once (nothing is fetched from a hub, so nothing retries); a folder without
    weights is named before any rank starts."""
    for path in ("/nonexistent/model", "deepseek-ai/DeepSeek-V3"):
        start = time.monotonic()
        assert launch(path, code=2) and f"{path!r} is not a directory: {ACCEPTED}" in launch.stderr
        assert time.monotonic() - start < 60
    empty = tmp_path / "empty"
    empty.mkdir()
    assert launch(str(empty), code=2) and f"{empty} has no config.json: {ACCEPTED}" in launch.stderr
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(Path(model_dirs["llama"]) / "config.json", no_weights)
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"no weights in {no_weights}: expected *.safetensors")
    ):
        Engine(model_path=str(no_weights), device="cpu")


def test_taken_port_fails_before_the_weights_load(model_dirs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert launch(model_dirs["llama"], "--port", str(port), code=2)
    assert f"cannot listen on 127.0.0.1:{port}" in launch.stderr and "Loading weights" not in launch.stderr


def test_a_rank_failing_at_start_names_its_cause(model_dirs, tmp_path):
    """A checkpoint whose tensors do not match its config fails inside the ranks: the server exits 1
    with the rank, the exception's type and message, and the rank's traceback in its log (and no
    leaked semaphore from the ranks that died)."""
    broken = tmp_path / "wrong_shapes"
    shutil.copytree(model_dirs["llama"], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(
        json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]})
    )
    assert launch(str(broken), "--tp", "2", code=1)
    # The loader reads in on-disk order: whichever MLP weight comes first names the cause.
    cause = re.search(
        r"worker rank 1 failed: ValueError: model\.layers\.0\.mlp\.(\w+)\.weight: dimension", launch.stderr
    )
    assert cause and cause[1] in ("gate_proj", "up_proj", "down_proj"), launch.stderr[-2000:]
    assert "has no part 1 of size 128" in launch.stderr
    assert "Traceback" in launch.stderr and "leaked semaphore" not in launch.stderr


def test_flags_that_do_nothing_are_named():
    cfg = EngineConfig("unused", tp_size=2, enable_dp_attention=True, speculative_num_steps=2)
    assert cfg.ignored_options() == [
        "speculative_num_steps=2 does nothing without speculative_algorithm",
        "enable_dp_attention=True does nothing with dp_size=1 (one attention group: plain TP)",
    ]
    assert EngineConfig("unused", tp_size=2, dp_size=2, enable_dp_attention=True).ignored_options() == []


def test_help_states_each_default_once():
    text = subprocess.run(
        [sys.executable, "-m", "dpserve.launch_server", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "(default: None)" not in text and "(default: False)" not in text
    entry = text[text.index("\n  --max-total-tokens MAX_TOTAL_TOKENS") :].split("\n  --")[1]
    assert entry.count("default") == 1  # "(default: from the memory budget)", not the formatter's too
    assert "--speculative-num-steps SPECULATIVE_NUM_STEPS" in text and "(default: 1)" in text


def test_dry_run_needs_no_dist_init_addr(model_dirs):
    """--dry-run starts nothing, so two nodes need no rendezvous address."""
    cmd = [sys.executable, "-m", "dpserve.launch_server", "--model-path", model_dirs["deepseek_v2"]]
    cmd += ["--tp", "2", "--nnodes", "2", "--dry-run", "--device", "cpu", "--kv-cache-memory-gb", "0.01"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_checkpoint_unlike_its_quantization_config_is_refused(model_dirs, tmp_path):
    """A config that says block FP8 over float32 tensors: refused at load naming the first tensor
    (quantizing it silently would hide a broken checkpoint; --quantization fp8 is the way to ask)."""
    quantized = tmp_path / "fp8"
    shutil.copytree(model_dirs["deepseek_v3"], quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        Exception,
        match=r"\.weight is torch.float32 in the checkpoint, but it is read as fp8 \(torch.float8_e4m3fn\)",
    ):
        Engine(model_path=str(quantized), device="cpu")


def test_max_running_requests_has_sglangs_meaning():
    """The instance's under DP attention, divided evenly among the groups; a replica's otherwise."""

    def per_group(**kwargs) -> int:
        return EngineConfig(model_path="smollm2-135m", device="cpu", **kwargs).running_per_group

    assert per_group(tp_size=4, dp_size=2, enable_dp_attention=True, max_running_requests=64) == 32
    assert per_group(tp_size=4, dp_size=4, enable_dp_attention=True, max_running_requests=66) == 16
    assert per_group(tp_size=1, dp_size=2, max_running_requests=64) == 64  # replicas
    assert per_group(tp_size=4, dp_size=2, enable_dp_attention=True) == 256  # unset: 256 per group


def test_chunked_prefill_size_has_sglangs_meaning():
    def per_group(**kwargs) -> int:
        return EngineConfig(model_path="smollm2-135m", device="cpu", **kwargs).chunk_per_group

    assert per_group(tp_size=4, dp_size=4, enable_dp_attention=True, chunked_prefill_size=8192) == 2048
    assert per_group(tp_size=1, dp_size=2, chunked_prefill_size=512) == 512  # replicas
    assert per_group(tp_size=4, dp_size=2, enable_dp_attention=True) == 2048  # unset: 2048 per group
    with pytest.raises(ValueError, match=re.escape("chunked_prefill_size=2 is divided among the dp_size=4")):
        per_group(tp_size=4, dp_size=4, enable_dp_attention=True, chunked_prefill_size=2)
