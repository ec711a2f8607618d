"""Block-FP8 checkpoints (DeepSeek-V3's format) served as they are: weights kept 8-bit, each rank's
part read with the scales of the blocks it touches (parts that start inside a block included), and
transformers' greedy tokens on the checkpoint dequantized by DeepSeek's rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GREEDY, NEW_TOKENS, assert_matches_reference
from safetensors.torch import load_file, save_file

from dpserve.layers.quant import BlockFP8, fp8_linear
from dpserve.models.config import ModelConfig
from dpserve.testing.reference import hf_greedy_reference
from dpserve.testing.tiny_models import dequantized_fp8_copy, quantize_fp8

# Ragged on purpose: 24-row and 40-column blocks leave partial edge blocks on every tiny tensor, and
# tp 2 splits (16 expert rows, 32 o_proj columns per rank) start inside a block.
BLOCK = (24, 40)


@pytest.fixture(scope="module")
def fp8_model(model_dirs, tmp_path_factory) -> str:
    return str(quantize_fp8(model_dirs["deepseek_v3"], tmp_path_factory.mktemp("fp8") / "v3", BLOCK))


@pytest.fixture(scope="module")
def fp8_references(fp8_model, prompts, tmp_path_factory):
    reference = dequantized_fp8_copy(fp8_model, tmp_path_factory.mktemp("fp8_dequantized") / "v3")
    return hf_greedy_reference(reference, prompts, NEW_TOKENS)


def test_a_weight_part_starting_inside_a_block_takes_that_blocks_scales():
    """fp8_linear on a part of rows 10..30 and columns 7..47 of a tensor in 8 x 16 blocks: the same
    product as the dequantized tensor's part."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(40, 64, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(5, 4, generator=g) + 0.1
    full = q.float() * scale.repeat_interleave(8, 0).repeat_interleave(16, 1)
    rows, cols = slice(10, 30), slice(7, 47)
    first_row, first_col = 10 // 8, 7 // 16
    part = BlockFP8(
        q[rows, cols],
        scale[first_row : -(-30 // 8), first_col : -(-47 // 16)],
        torch.arange(10, 30) // 8 - first_row,
        torch.arange(7, 47) // 16 - first_col,
    )
    x = torch.randn(3, 40, generator=g)
    torch.testing.assert_close(fp8_linear(x, part), x @ full[rows, cols].T, rtol=0, atol=0)


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 2)])
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_copy(
    engine_cache, fp8_model, fp8_references, prompts, tp, dp
):
    engine = engine_cache.get(
        fp8_model, tp_size=tp, dp_size=dp, enable_dp_attention=dp > 1, kv_cache_memory_gb=0.002
    )
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, fp8_references)


def test_fp8_weights_stay_8_bit(engine_cache, fp8_model, model_dirs):
    """At tp 1 the FP8 engine's weights are the float32 one's less 3 bytes per quantized element
    plus 4 per block scale, for every quantized tensor but MLA's kv_b_proj (widened at load: read
    as a tensor by the absorbed attention)."""
    infos = {
        path: engine_cache.info(
            path, tp_size=1, dp_size=1, enable_dp_attention=False, kv_cache_memory_gb=0.002
        )
        for path in (fp8_model, model_dirs["deepseek_v3"])
    }
    tensors = {k: v for f in Path(fp8_model).glob("*.safetensors") for k, v in load_file(f).items()}
    saved = sum(
        3 * tensors[name.removesuffix("_scale_inv")].numel() - 4 * tensors[name].numel()
        for name in tensors
        if name.endswith("_scale_inv") and "kv_b_proj" not in name
    )
    fp8, fp32 = (infos[p]["dp_ranks"][0]["weight_bytes"] for p in (fp8_model, model_dirs["deepseek_v3"]))
    assert fp32 - fp8 == saved > 0


def test_unserved_and_malformed_quantization_is_refused_by_name(fp8_model, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fp8_model, bad)
    config = json.loads((bad / "config.json").read_text())
    for quant, message in (
        ({"quant_method": "awq", "bits": 4}, "quant_method='awq' is not supported; dpserve serves"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_block_size=None"),
    ):
        (bad / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
        with pytest.raises(ValueError, match=message):
            ModelConfig.load(str(bad))
    (bad / "config.json").write_text(json.dumps(config))
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name][:2].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    from dpserve import Engine

    with pytest.raises(
        Exception,
        match=r"weight_scale_inv has shape \(2, 1\), but .* \(64, 32\) in blocks of \[24, 40\] .* needs \(3, 1\)",
    ):
        Engine(model_path=str(bad), device="cpu", dtype="float32", kv_cache_memory_gb=0.002)
