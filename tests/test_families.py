"""The families served besides DeepSeek-V2/V3 and Llama (docs/design.md, "Model families"): each
tiny random checkpoint, written by transformers, gives transformers' greedy tokens in every layout.
Kimi-K2 is DeepSeek-V3's architecture under its own config.json (model_type kimi_k2, code in
auto_map), which dpserve reads without running the checkpoint's code. Qwen3-MoE: GQA with a head_dim
that is not hidden / heads, per-head q/k norm, softmax top-k renormalised, no shared experts, a dense
layer among the MoE ones (mlp_only_layers). GLM-4.5: GQA with q/k/v biases, q/k norm and rotary on
half of each head, DeepSeek-V3's grouped sigmoid routing with a shared expert, its MTP layer drafting
for NEXTN. gpt-oss: biases on q/k/v/o, attention sinks, a sliding window on every other layer that the
prompts outgrow, YaRN, a biased router with softmax over the top-k logits, experts with biases and the
clamped SwiGLU stored fused with gate and up interleaved."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_ARCHS, GREEDY, KV_BUDGET_GB, SMALL_POOL, assert_matches_reference
from openai import OpenAI
from safetensors.torch import load_file
from transformers import AutoTokenizer

from dpserve.models.config import ModelConfig
from dpserve.models.loader import CheckpointReader
from dpserve.models.tokenizer import load_tokenizer
from dpserve.testing.reference import hf_greedy_reference
from dpserve.testing.server import ServerProcess
from dpserve.testing.tiny_models import dequantized_copy, quantize_experts_mxfp4, write_tiny_model


@pytest.fixture(scope="module")
def kimi(model_dirs) -> str:
    return model_dirs["kimi_k2"]


@pytest.fixture(scope="module")
def qwen3_moe(model_dirs) -> str:
    return model_dirs["qwen3_moe"]


@pytest.fixture(scope="module")
def family_refs(model_dirs, prompts) -> dict:
    return {a: hf_greedy_reference(model_dirs[a], prompts, GREEDY["max_new_tokens"]) for a in FAMILY_ARCHS}


def test_kimi_config_is_read_without_its_code(kimi):
    raw = json.loads((Path(kimi) / "config.json").read_text())
    assert raw["model_type"] == "kimi_k2" and "AutoConfig" in raw["auto_map"]  # as Moonshot ships it
    cfg = ModelConfig.load(kimi)
    assert (cfg.family, cfg.arch, cfg.is_mla) == ("kimi_k2", "DeepseekV3ForCausalLM", True)
    assert (cfg.hf.n_group, cfg.hf.topk_group, cfg.hf.routed_scaling_factor) == (1, 1, 2.827)


def test_qwen3_moe_config_declares_its_layers(qwen3_moe):
    cfg = ModelConfig.load(qwen3_moe)
    assert (cfg.family, cfg.is_mla, cfg.declaration.qk_norm(cfg.hf)) == ("qwen3_moe", False, True)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.scoring, moe.norm_topk_prob, moe.shared_intermediate_size) == (
        8,
        2,
        "softmax",
        True,
        0,
    )
    assert cfg.dense_layers == [1]  # mlp_only_layers


# Every layout of the list: (1,1), (2,2), (4,2) and (4,4) with 4-way expert parallelism, the
# dispatch path varied over the families; Qwen3 (dense) split over two attention-TP ranks.
LAYOUTS = [(1, 1, 1, "none"), (2, 2, 1, "none"), (4, 2, 1, "none")]
CASES = [
    # Kimi-K2 runs DeepSeek-V3's code under its own config (test_parity.py has V3 in every layout).
    *[("kimi_k2", *layout) for layout in [(1, 1, 1, "none"), (4, 4, 4, "none")]],
    *[("qwen3_moe", *layout) for layout in [*LAYOUTS, (4, 4, 4, "all_to_all")]],
    *[("glm4_moe_mtp", *layout) for layout in [*LAYOUTS, (4, 4, 4, "all_to_all")]],
    *[("gpt_oss", *layout) for layout in [*LAYOUTS, (4, 4, 4, "none")]],
    *[("deepseek_v32", *layout) for layout in [*LAYOUTS, (4, 4, 4, "all_to_all")]],  # more in test_dsa.py
    ("qwen3", 2, 1, 1, "none"),
]


@pytest.mark.parametrize("arch,tp,dp,ep,a2a", CASES)
def test_greedy_matches_transformers(engine_cache, model_dirs, family_refs, prompts, arch, tp, dp, ep, a2a):
    engine = engine_cache.get(
        model_dirs[arch],
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=dp > 1,
        ep_size=ep,
        moe_a2a_backend=a2a,
        kv_cache_memory_gb=KV_BUDGET_GB,
    )
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, family_refs[arch])


def test_glm4_moe_nextn_drafts_with_its_mtp_layer(engine_cache, model_dirs, family_refs, prompts):
    """GLM-4.5's MTP layer (GQA + MoE, its KV in a pool of its own) drafts two tokens a step under DP
    attention; verification keeps transformers' greedy tokens."""
    engine = engine_cache.get(
        model_dirs["glm4_moe_mtp"],
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        speculative_algorithm="NEXTN",
        speculative_num_steps=2,
        kv_cache_memory_gb=KV_BUDGET_GB,
    )
    assert engine.get_server_info()["speculative_algorithm"] == "NEXTN"
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, family_refs["glm4_moe_mtp"])
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)  # tokens after the first were verified


def test_gpt_oss_reads_its_windows_sinks_and_fused_experts(model_dirs):
    cfg = ModelConfig.load(model_dirs["gpt_oss"])
    moe = cfg.moe
    assert (moe.scoring, moe.activation, moe.checkpoint, moe.router_bias, moe.expert_bias) == (
        "topk_softmax",
        "swiglu_clamped",
        "fused",
        True,
        True,
    )
    assert (cfg.hf.sliding_window, cfg.hf.layer_types[:2]) == (8, ["sliding_attention", "full_attention"])
    assert cfg.declaration.sinks and cfg.declaration.attention_bias == "qkvo"


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(model_dirs, tmp_path_factory) -> tuple[str, str]:
    """(an MXFP4 gpt-oss checkpoint, its float32 copy dequantized by transformers)."""
    root = tmp_path_factory.mktemp("mxfp4")
    path = root / "mxfp4"
    shutil.copytree(model_dirs["gpt_oss"], path)
    quantize_experts_mxfp4(path)
    return str(path), str(dequantized_copy(path, root / "dequantized"))


def test_mxfp4_experts_read_as_transformers_dequantizes_them(gpt_oss_mxfp4):
    """Whole, per expert, and a rank's part that starts and ends inside a group of 32: the same
    float32 values as transformers' own dequantization."""
    path, reference = gpt_oss_mxfp4
    ref = load_file(str(Path(reference) / "model.safetensors"))
    reader = CheckpointReader(path)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert name not in load_file(str(Path(path) / "model.safetensors"))  # blocks and scales only
        tensor = reader.slice(name)
        assert tensor.get_shape() == list(ref[name].shape)
        assert torch.equal(tensor[:], ref[name])
        parts = (slice(2, 5), slice(8, 16), slice(None))
        assert torch.equal(tensor[parts], ref[name][parts])


def test_mxfp4_gpt_oss_greedy_matches_transformers(engine_cache, gpt_oss_mxfp4, prompts):
    path, reference = gpt_oss_mxfp4
    assert ModelConfig.load(path).hf.quantization_config["quant_method"] == "mxfp4"
    engine = engine_cache.get(
        path, tp_size=4, dp_size=2, enable_dp_attention=True, kv_cache_memory_gb=KV_BUDGET_GB
    )
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, hf_greedy_reference(reference, prompts, GREEDY["max_new_tokens"]))


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe", "deepseek_v32"])
def test_features_compose_with_the_family(engine_cache, model_dirs, family_refs, prompts, arch):
    """Chunked prefill (8 tokens per group), a pool small enough to retract, prefix-cache hits (every
    prompt twice, side by side in one group), NGRAM drafts and the DP LM head, under DP attention
    with expert parallelism: every output still transformers' greedy one."""
    engine = engine_cache.get(
        model_dirs[arch],
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        ep_size=2,
        enable_dp_lm_head=True,
        chunked_prefill_size=16,
        max_total_tokens=SMALL_POOL,
        load_balance_method="round_robin",
        speculative_algorithm="NGRAM",
        speculative_num_steps=3,
    )
    metrics_before = engine.get_metrics()
    outs = engine.generate(input_ids=prompts * 2, sampling_params=GREEDY, return_logprob=True)
    for k in range(2):
        assert_matches_reference(outs[k * len(prompts) : (k + 1) * len(prompts)], family_refs[arch])
    metrics = engine.get_metrics()
    assert sum(m["retractions"] for m in metrics) > sum(m["retractions"] for m in metrics_before)
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)


def test_chat_completions_render_the_familys_template(engine_cache, model_dirs):
    """gpt-oss's tiny checkpoint carries harmony's turn format: /v1/chat/completions renders that
    template (not another family's), streamed or not, under DP attention with the hybrid window
    pool, and answers what the engine answers for the rendered ids."""
    path, chat = model_dirs["gpt_oss"], [{"role": "user", "content": "Where does the train go?"}]
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<|start|>user<|message|>Where does the train go?<|end|><|start|>assistant"
    ids = tok.encode(text, add_special_tokens=False)
    layout = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "kv_cache_memory_gb": KV_BUDGET_GB}
    expected = engine_cache.get(path, **layout).generate(input_ids=ids, sampling_params=GREEDY)
    engine_cache.close()  # two cores: not beside the server
    flags = ["--tp", "2", "--dp", "2", "--enable-dp-attention", "--kv-cache-memory-gb", str(KV_BUDGET_GB)]
    with ServerProcess("--model-path", path, "--dtype", "float32", *flags) as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        common = {"model": path, "messages": chat, "max_tokens": GREEDY["max_new_tokens"], "temperature": 0}
        reply = client.chat.completions.create(**common, extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(**common, stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == GREEDY["max_new_tokens"]
    assert reply.choices[0].message.content == streamed == expected["text"]


def test_gpt_oss_compiled_decode(engine_cache, model_dirs, family_refs, prompts):
    """torch.compile of padded decode steps through sinks, windows and the biased experts."""
    engine = engine_cache.get(
        model_dirs["gpt_oss"],
        enable_torch_compile=True,
        cuda_graph_bs=(8,),
        kv_cache_memory_gb=KV_BUDGET_GB,
    )
    engine.get_step_log()
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, family_refs["gpt_oss"])
    decode = [s for s in engine.get_step_log()[0] if s.kind == "decode"]
    assert decode and all(s.padded for s in decode)


def test_gpt_oss_on_the_reference_backend(engine_cache, model_dirs, family_refs, prompts):
    """SDPA's path for windows (a mask) and sinks (its own softmax), decode rows included."""
    engine = engine_cache.get(
        model_dirs["gpt_oss"],
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        attention_backend="sdpa",
        kv_cache_memory_gb=KV_BUDGET_GB,
    )
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, family_refs["gpt_oss"])


def test_gpt_oss_on_the_triton_kernels(engine_cache, model_dirs, family_refs, prompts):
    """The GPU's paged kernels (Triton's interpreter here) with windows and sinks, through the engine:
    prefill by the extend kernel, decode by the split-K kernel (three prompts, the interpreter is
    slow: 11, 39 and 7 tokens against a window of 8)."""
    engine = engine_cache.get(
        model_dirs["gpt_oss"],
        attention_backend="triton",
        dp_padding_mode="sum_len",
        kv_cache_memory_gb=KV_BUDGET_GB,
    )
    outs = engine.generate(input_ids=prompts[:3], sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, family_refs["gpt_oss"][:3])


@pytest.mark.parametrize(
    "model_type,arch,message",
    [
        (
            "mixtral",
            "MixtralForCausalLM",
            "unsupported architecture 'MixtralForCausalLM' (model_type 'mixtral')",
        ),
        ("made_up", "MadeUpForCausalLM", "model_type 'made_up' is not one dpserve can read"),
    ],
)
def test_a_family_not_served_is_refused_naming_those_that_are(tmp_path, model_type, arch, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))
    with pytest.raises(ValueError) as e:
        ModelConfig.load(str(tmp_path))
    assert message in str(e.value)
    assert "Qwen3MoeForCausalLM (model_type qwen3_moe)" in str(e.value)
    assert "DeepseekV3ForCausalLM (model_type kimi_k2)" in str(e.value)


def test_a_tokenizer_only_its_own_code_reads_stops_the_server_at_start(tmp_path):
    """A tokenizer transformers reads only by running the checkpoint's code (and no tiktoken.model
    to convert): the server exits 2 naming why; nothing prompts, nothing runs that code, no rank is
    left."""
    path = write_tiny_model("kimi_k2", tmp_path / "kimi")
    (path / "tokenizer.json").unlink()
    remote = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TikTokenTokenizer", "auto_map": remote})
    )
    run = subprocess.run(
        [sys.executable, "-m", "dpserve.launch_server", "--model-path", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "its tokenizer cannot be loaded without running code shipped with the checkpoint" in run.stderr


def test_kimis_tiktoken_tokenizer_is_converted_without_its_code(tmp_path):
    """tiktoken.model (base64 token, rank) as a fast byte-level BPE: merges in rank order as
    tiktoken applies them, runs of Han characters split apart, special tokens at the ids after the
    ranks (named by added_tokens_decoder, else reserved), its chat template; decode inverts encode."""
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" t", b" the", b"in", b"ing"]
    han = "中".encode()
    ranks += [han[:2], han]
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks))
    )
    n = len(ranks)
    named = {str(n): "[BOS]", str(n + 1): "[EOS]", str(n + 3): "<|im_end|>"}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": {i: {"content": t, "special": True} for i, t in named.items()},
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]"},
        "chat_template": "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (n, n + 1, n + 258)
    assert tok.convert_ids_to_tokens(n + 2) == f"<|reserved_token_{n + 2}|>"
    the, th, ing, space, han_id = 258, 256, 262, 32, n - 1
    cases = {
        "the thing": [the, space, th, ing],  # " thing": "th" (rank 256) merges before " t" (259)
        "中中文 the": [han_id, han_id, *"文".encode(), 260],  # the Han run apart from " the"
        "hi<|im_end|>": [104, 105, n + 3],
    }
    for text, ids in cases.items():
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.decode(ids) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi<|im_end|>"
