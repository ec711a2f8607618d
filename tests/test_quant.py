"""8-bit checkpoints served as they are. Block FP8 (DeepSeek-V3's format): weights kept 8-bit, each
rank's part read with the scales of the blocks it touches (parts that start inside a block included),
and transformers' greedy tokens on the checkpoint dequantized by DeepSeek's rule. W8A8-INT8 (SGLang's
w8a8_int8): the fused CPU kernel gives its plain PyTorch form's bits, and the engine transformers'
tokens on the dequantized checkpoint with its activations rounded as each rank rounds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GREEDY, NEW_TOKENS, PRESSURE, assert_matches_reference, generate_under_pressure
from safetensors.torch import load_file, save_file

from dpserve import cpu_ops
from dpserve.layers.quant import QuantizedWeight, dequantize, fp8_linear, int8_linear
from dpserve.models.config import ModelConfig
from dpserve.testing.reference import Int8Activations, hf_greedy_reference
from dpserve.testing.tiny_models import UNQUANTIZED, dequantized_8bit_copy, quantize_fp8, quantize_int8

# Ragged on purpose: 24-row and 40-column blocks leave partial edge blocks on every tiny tensor, and
# tp 2 splits (16 expert rows, 32 o_proj columns per rank) start inside a block.
BLOCK = (24, 40)


@pytest.fixture(scope="module")
def fp8_models(model_dirs, tmp_path_factory) -> dict[str, str]:
    """Each family's tiny checkpoint in block FP8, written when first asked for."""
    root = tmp_path_factory.mktemp("fp8")

    class Models(dict):
        def __missing__(self, arch: str) -> str:
            self[arch] = str(quantize_fp8(model_dirs[arch], root / arch, BLOCK))
            return self[arch]

    return Models()


@pytest.fixture(scope="module")
def fp8_model(fp8_models) -> str:
    return fp8_models["deepseek_v3"]


@pytest.fixture(scope="module")
def fp8_references(fp8_models, prompts, tmp_path_factory):
    """transformers' greedy outputs on each FP8 checkpoint dequantized by DeepSeek's rule."""
    root = tmp_path_factory.mktemp("fp8_dequantized")

    class References(dict):
        def __missing__(self, arch: str):
            reference = dequantized_8bit_copy(fp8_models[arch], root / arch)
            self[arch] = hf_greedy_reference(reference, prompts, NEW_TOKENS)
            return self[arch]

    return References()


def test_a_weight_part_starting_inside_a_block_takes_that_blocks_scales():
    """fp8_linear on a part of rows 10..30 and columns 7..47 of a tensor in 8 x 16 blocks: the same
    product as the dequantized tensor's part."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(40, 64, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(5, 4, generator=g) + 0.1
    full = q.float() * scale.repeat_interleave(8, 0).repeat_interleave(16, 1)
    rows, cols = slice(10, 30), slice(7, 47)
    first_row, first_col = 10 // 8, 7 // 16
    part = QuantizedWeight(
        q[rows, cols],
        scale[first_row : -(-30 // 8), first_col : -(-47 // 16)],
        torch.arange(10, 30) // 8 - first_row,
        torch.arange(7, 47) // 16 - first_col,
    )
    x = torch.randn(3, 40, generator=g)
    torch.testing.assert_close(fp8_linear(x, part), x @ full[rows, cols].T, rtol=0, atol=0)
    assert cpu_ops.load()
    fused = torch.ops.dpserve_cpu.fp8_linear(x, part.q, part.scale, part.row_block, part.col_block, None)
    torch.testing.assert_close(fused, x @ full[rows, cols].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_kernel_widens_every_fp8_value_exactly(dtype):
    """The fused kernel widens each of the 254 finite float8_e4m3fn values (subnormals and both
    zeros included) exactly: with one-hot inputs each output is a weight times its block's scale;
    and on ragged shapes it gives the float64 product (rounded once to x's dtype) with a bias."""
    assert cpu_ops.load()
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaNs
    q = codes.view(torch.float8_e4m3fn).view(2, 127)
    scale = torch.tensor([[0.5, 3.0], [2.0**-9, 1.0]])
    row_block, col_block = torch.tensor([0, 1]), (torch.arange(127) >= 40).long()
    eye = torch.eye(127, dtype=dtype)
    fused = torch.ops.dpserve_cpu.fp8_linear(eye, q, scale, row_block, col_block, None)
    widened = q.float() * scale[row_block[:, None], col_block[None, :]]
    assert torch.equal(fused, widened.T.to(dtype))
    g = torch.Generator().manual_seed(0)
    for tokens, k, n in ((0, 5, 3), (1, 5, 3), (2, 130, 9), (7, 37, 9), (16, 333, 70)):  # fused and tiled
        x = torch.randn(tokens, k, generator=g).to(dtype)
        q = (torch.randn(n, k, generator=g) * 100).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // 8), -(-k // 24), generator=g)
        row_block, col_block = torch.arange(n) // 8, torch.arange(k) // 24
        bias = torch.randn(n, generator=g)
        w = dequantize(q, scale, row_block, col_block, torch.float64)
        exact = x.double() @ w.T + bias.double()
        fused = torch.ops.dpserve_cpu.fp8_linear(x, q, scale, row_block, col_block, bias)
        # float32 sums (k roundings of at most the terms' magnitude), then one rounding to dtype
        bound = k * 2.0**-24 * (x.double().abs() @ w.abs().T + bias.double().abs())
        bound += torch.finfo(dtype).eps * exact.abs()
        assert ((fused.double() - exact).abs() <= bound).all()


# Families that ship block FP8, over the layouts: MLA (V3, V3.2's indexer, Kimi's V3 code), GQA with
# fused q|k|v (Qwen3-MoE, Qwen3 dense over two attention-TP ranks), whole experts under expert
# parallelism with all_to_all dispatch, GLM-4.5's MTP layer drafting for NEXTN.
CASES = [
    ("deepseek_v3", 1, 1, {}),
    ("deepseek_v3", 2, 2, {}),
    ("deepseek_v3", 4, 4, {"ep_size": 4, "moe_a2a_backend": "all_to_all"}),
    ("deepseek_v32", 2, 2, {}),
    ("qwen3_moe", 4, 2, {}),
    ("qwen3", 2, 1, {}),
    ("glm4_moe_mtp", 2, 2, {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}),
]


@pytest.mark.parametrize("arch,tp,dp,options", CASES)
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_8bit_copy(
    engine_cache, fp8_models, fp8_references, prompts, arch, tp, dp, options
):
    engine = engine_cache.get(
        fp8_models[arch],
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=dp > 1,
        kv_cache_memory_gb=0.002,
        **options,
    )
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, fp8_references[arch])
    if options.get("speculative_algorithm"):
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outputs)


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
    unserved = ("awq", "gptq", "compressed-tensors", "modelopt", "bitsandbytes", "fbgemm_fp8", "mxfp4")
    for quant, message in (
        *(
            (
                {"quant_method": m, "bits": 4},
                f"quant_method='{m}' is not supported; dpserve serves .* W8A8-INT8",
            )
            for m in unserved
        ),
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


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_at_load(
    engine_cache, model_dirs, tmp_path, prompts
):
    """--quantization fp8 on the float32 tiny DeepSeek-V3 keeps the same FP8 weights and scales as the
    checkpoint quantized offline in DeepSeek-V3's 128 x 128 blocks (kv_b_proj aside: read as a tensor,
    it stays in the model's dtype): the same tokens and weight bytes, logprobs within 1e-5."""
    keep = (*UNQUANTIZED, "kv_b_proj")
    offline = str(quantize_fp8(model_dirs["deepseek_v3"], tmp_path / "v3", (128, 128), keep))
    outputs = []
    for path, options in ((offline, {}), (model_dirs["deepseek_v3"], {"quantization": "fp8"})):
        engine = engine_cache.get(path, kv_cache_memory_gb=0.002, **options)
        outputs.append(engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True))
    assert [o["output_ids"] for o in outputs[0]] == [o["output_ids"] for o in outputs[1]]
    for offline_out, online_out in zip(*outputs, strict=True):
        pairs = zip(
            *(o["meta_info"]["output_token_logprobs"] for o in (offline_out, online_out)), strict=True
        )
        assert all(abs(a - b) < 1e-5 for a, b in pairs)
    info = engine_cache.info(model_dirs["deepseek_v3"], kv_cache_memory_gb=0.002, quantization="fp8")
    assert (
        info["dp_ranks"][0]["weight_bytes"]
        == engine_cache.info(offline, kv_cache_memory_gb=0.002)["dp_ranks"][0]["weight_bytes"]
    )


def test_quantization_flag_refuses_what_it_cannot_serve(model_dirs, fp8_model, tmp_path):
    import shutil

    from dpserve.testing.tiny_models import quantize_experts_mxfp4

    mxfp4 = tmp_path / "gpt_oss"
    shutil.copytree(model_dirs["gpt_oss"], mxfp4)
    quantize_experts_mxfp4(mxfp4)
    with pytest.raises(
        ValueError, match="--quantization fp8, but its quantization_config says quant_method='mxfp4'"
    ):
        ModelConfig.load(str(mxfp4), "fp8")
    assert ModelConfig.load(fp8_model, "fp8").quant.block == BLOCK  # the checkpoint's own blocks
    assert ModelConfig.load(model_dirs["deepseek_v3"]).quant is None
    assert ModelConfig.load(model_dirs["deepseek_v3"], "fp8").quant.block == (128, 128)


# W8A8-INT8 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_kernel_gives_the_plain_pytorch_forms_bits(dtype):
    """The fused kernel against int8_linear on ragged shapes (k not a multiple of its 16-lane step,
    tokens and rows not of its 3 x 4 tile), a bias, and a token of zeros; and int8_linear's integer
    dot products against an int64 matmul."""
    assert cpu_ops.load()
    g = torch.Generator().manual_seed(0)
    for tokens, k, n in ((0, 5, 3), (1, 5, 3), (7, 37, 9), (16, 333, 70)):
        x = (torch.randn(tokens, k, generator=g) * 3).to(dtype)
        x[tokens // 2 : tokens // 2 + 1] = 0
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale, bias = torch.rand(n, generator=g) / 100, torch.randn(n, generator=g)
        for b in (None, bias):
            fused = torch.ops.dpserve_cpu.int8_linear(x, q, scale, b)
            torch.testing.assert_close(fused, int8_linear(x, q, scale, b), rtol=0, atol=0)
        amax = x.float().abs().amax(-1, keepdim=True)
        levels = torch.round(x.float() * (torch.full_like(amax, 127) / amax)).nan_to_num(0).long()
        exact = (levels @ q.long().T).float() * (amax / 127) * scale
        torch.testing.assert_close(int8_linear(x, q, scale).float(), exact.to(dtype).float(), rtol=0, atol=0)


INT8_BOUND = 0.1  # logprobs


def assert_matches_rounded_reference(outputs: list[dict], refs) -> None:
    """W8A8-INT8 against its rounded reference: most steps agree to 1e-6, but an input that float
    noise moves across a rounding boundary (one level of one element) moves a tiny model's logprobs
    by up to a few hundredths. So: logprobs within INT8_BOUND while the tokens agree; a prompt's
    tokens may part only at a step whose reference top-2 logits are closer than twice it; and most
    steps are compared."""
    compared = 0
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        ids = out["output_ids"]
        n = next(
            (k for k, (a, b) in enumerate(zip(ids, ref.output_ids, strict=True)) if a != b),
            len(ref.output_ids),
        )
        lps = out["meta_info"]["output_token_logprobs"]
        for step in range(n):
            assert abs(lps[step] - ref.logprobs[step]) < INT8_BOUND, f"prompt {i} step {step}"
        if n < len(ref.output_ids):
            assert ref.margins[n] < 2 * INT8_BOUND, (
                f"prompt {i}: tokens part at step {n}, margin {ref.margins[n]}"
            )
        compared += n
    assert compared >= 0.75 * len(refs) * NEW_TOKENS


INT8_KEEP = (*UNQUANTIZED, "kv_b_proj")  # MLA's kv_b_proj is widened at load: its input stays unrounded
# (arch, tp, dp, row-parallel weights split over ranks: each rank rounds its own columns of their input)
NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
INT8_CASES = [
    ("deepseek_v3", 1, 1, {}, {}),
    ("deepseek_v3", 2, 2, {"down_proj": 2}, {}),  # DP attention: o_proj whole in each group, MLPs split
    ("qwen3_moe", 4, 2, {"down_proj": 4, "o_proj": 2}, {}),
    ("qwen3", 2, 1, {"down_proj": 2, "o_proj": 2}, {}),
    ("glm4_moe_mtp", 2, 2, {"down_proj": 2}, NEXTN),  # its int8 MTP layer drafting
]


@pytest.fixture(scope="module")
def int8_models(model_dirs, tmp_path_factory) -> dict[str, str]:
    """Each family's tiny checkpoint in W8A8-INT8 with no quantization_config (as meituan's
    DeepSeek-R1-Channel-INT8 ships), written when first asked for."""
    root = tmp_path_factory.mktemp("int8")

    class Models(dict):
        def __missing__(self, arch: str) -> str:
            self[arch] = str(quantize_int8(model_dirs[arch], root / arch))
            return self[arch]

    return Models()


@pytest.mark.parametrize("arch,tp,dp,parts,options", INT8_CASES)
def test_int8_checkpoint_matches_transformers_with_its_activations_rounded(
    engine_cache, int8_models, prompts, tmp_path, arch, tp, dp, parts, options
):
    """--quantization w8a8_int8 on an int8 checkpoint: transformers on its dequantized copy, each
    quantized linear's input rounded per token as the ranks round it, gives the same greedy tokens
    and logprobs as `assert_matches_rounded_reference` bounds them."""
    reference = dequantized_8bit_copy(int8_models[arch], tmp_path / arch)
    rounding = Int8Activations(INT8_KEEP, parts)
    refs = hf_greedy_reference(reference, prompts, NEW_TOKENS, rounding)
    engine = engine_cache.get(
        int8_models[arch],
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=dp > 1,
        kv_cache_memory_gb=0.002,
        quantization="w8a8_int8",
        **options,
    )
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_rounded_reference(outputs, refs)
    if options:
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outputs)


def test_quantization_w8a8_int8_quantizes_at_load_as_offline(engine_cache, model_dirs, prompts, tmp_path):
    """--quantization w8a8_int8 on the float32 tiny DeepSeek-V3 keeps the int8 weights and scales of
    the checkpoint quantized offline (kv_b_proj aside): the same tokens and logprobs, and weights 3
    bytes per element smaller than float32 less 4 per row's scale; a quantization_config saying
    w8a8_int8 is read without the flag."""
    offline = str(quantize_int8(model_dirs["deepseek_v3"], tmp_path / "v3", INT8_KEEP))
    online = {"quantization": "w8a8_int8"}
    outputs = [
        engine_cache.get(path, kv_cache_memory_gb=0.002, **options).generate(
            input_ids=prompts, sampling_params=GREEDY, return_logprob=True
        )
        for path, options in ((offline, online), (model_dirs["deepseek_v3"], online))
    ]
    assert [o["output_ids"] for o in outputs[0]] == [o["output_ids"] for o in outputs[1]]
    for a, b in zip(*outputs, strict=True):
        assert a["meta_info"]["output_token_logprobs"] == pytest.approx(
            b["meta_info"]["output_token_logprobs"], abs=1e-5
        )
    weight_bytes = {
        path: engine_cache.info(path, kv_cache_memory_gb=0.002, **options)["dp_ranks"][0]["weight_bytes"]
        for path, options in ((offline, online), (model_dirs["deepseek_v3"], {}))
    }
    tensors = {k: v for f in Path(offline).glob("*.safetensors") for k, v in load_file(f).items()}
    saved = sum(
        3 * tensors[name.removesuffix("_scale")].numel() - 4 * tensors[name].numel()
        for name in tensors
        if name.endswith("_scale")
    )
    assert weight_bytes[model_dirs["deepseek_v3"]] - weight_bytes[offline] == saved > 0
    assert ModelConfig.load(model_dirs["deepseek_v3"], "w8a8_int8").quant.method == "w8a8_int8"


def test_int8_checkpoints_say_what_they_need(int8_models, tmp_path):
    """An int8 checkpoint without quantization_config and without the flag is refused naming the
    flag; with `quant_method: w8a8_int8` in its config it needs none; a mis-shaped scale is named."""
    import shutil

    from dpserve import Engine

    bad = tmp_path / "int8"
    shutil.copytree(int8_models["qwen3"], bad)
    with pytest.raises(Exception, match=r"torch.int8 in the checkpoint.*--quantization w8a8_int8"):
        Engine(model_path=str(bad), device="cpu", dtype="float32", kv_cache_memory_gb=0.002)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "w8a8_int8"}
    (bad / "config.json").write_text(json.dumps(config))
    assert ModelConfig.load(str(bad)).quant.method == "w8a8_int8"
    with pytest.raises(
        ValueError, match="--quantization fp8, but its quantization_config says quant_method='w8a8_int8'"
    ):
        ModelConfig.load(str(bad), "fp8")
    (shard,) = bad.glob("*.safetensors")
    tensors = load_file(shard)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:3].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(
        Exception, match=rf"{name} has shape \(3, 1\), but .* in a scale per row \(w8a8_int8\) needs"
    ):
        Engine(model_path=str(bad), device="cpu", dtype="float32", kv_cache_memory_gb=0.002)


def test_8_bit_weights_through_chunks_prefix_hits_and_retraction(
    engine_cache, fp8_models, fp8_references, int8_models, prompts, tmp_path
):
    """Chunks of 8 tokens per group, every prompt twice side by side (prefix-cache hits), a pool
    small enough to retract, at (2,2) DP attention: block FP8 gives transformers' tokens and
    logprobs as without them, and W8A8-INT8 its rounded reference's (`assert_matches_rounded_reference`)."""
    int8_refs = hf_greedy_reference(
        dequantized_8bit_copy(int8_models["deepseek_v3"], tmp_path / "int8"),
        prompts,
        NEW_TOKENS,
        Int8Activations(INT8_KEEP, {"down_proj": 2}),
    )
    for path, refs, extra, check in (
        (fp8_models["deepseek_v3"], fp8_references["deepseek_v3"], {}, assert_matches_reference),
        (
            int8_models["deepseek_v3"],
            int8_refs,
            {"quantization": "w8a8_int8"},
            assert_matches_rounded_reference,
        ),
    ):
        for outs in generate_under_pressure(engine_cache.get(path, **PRESSURE, **extra), prompts):
            check(outs, refs)
