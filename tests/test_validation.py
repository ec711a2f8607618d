"""Invalid layouts and model shapes fail at construction, naming the numbers, before any process starts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ARCHS

from dpserve import Engine
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
        ({"tp_size": 2, "nnodes": 2}, "nnodes > 1 needs dist_init_addr"),
        ({"nnodes": 2, "node_rank": 2}, "node_rank=2 must be in [0, nnodes=2)"),
        ({"tp_size": 0}, "tp_size and dp_size must be >= 1"),
        ({"dp_padding_mode": "bogus"}, "dp_padding_mode must be one of"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs must be >= 1, got 0"),
        ({"cuda_graph_bs": [4, 0]}, "cuda_graph_bs must list batch sizes >= 1, got [0, 4]"),
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
    ],
)
def test_launch_server_rejects_bad_flags_and_shapes(model_dirs, flags, message):
    """The server exits non-zero at start-up, before any rank starts, naming the numbers."""
    cmd = [sys.executable, "-m", "dpserve.launch_server", "--model-path", model_dirs["deepseek_v2"], *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_quantized_checkpoint_is_refused(model_dirs, tmp_path):
    """DeepSeek-V3's official FP8 weights carry a quantization_config: refused at start-up, naming it."""
    quantized = tmp_path / "fp8"
    shutil.copytree(model_dirs["deepseek_v3"], quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape("quant_method='fp8' is not supported")):
        Engine(model_path=str(quantized), device="cpu")
