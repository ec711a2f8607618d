"""The families dpserve serves (docs/design.md, section 13), each a declaration of how its config
reads and what its layers compute; the decoder stack, DPComm, the MoE layer and expert parallelism
are shared by all of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

from dpserve.layers.specs import MoESpec


@dataclass(frozen=True)
class Family:
    """One `model_type`: the architectures it names, its attention, its MoE (None: dense)."""

    archs: tuple[str, ...]
    attention: str  # mla | gqa
    moe: Callable[[PretrainedConfig], MoESpec | None] = lambda hf: None
    qk_norm: Callable[[PretrainedConfig], bool] = lambda hf: (
        False
    )  # per-head RMSNorm on q and k before rotary
    # What attention_bias=true puts biases on: qkv (GLM), qkvo (gpt-oss); "": refused.
    attention_bias: str = ""
    sinks: bool = False  # a learned logit per head in the softmax's denominator (gpt-oss)
    quantizations: tuple[str, ...] = ()  # quant_methods dequantized at load (gpt-oss: mxfp4 experts)
    sparse_attention: bool = False  # DeepSeek-V3.2: an indexer picks the keys MLA attends to
    config_as: str = ""  # read as this model_type (its own config code is never run)


def deepseek_moe(hf: PretrainedConfig) -> MoESpec | None:
    v3 = hf.model_type in ("deepseek_v3", "deepseek_v32")  # sigmoid with a correction bias unless told
    scoring = getattr(hf, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    method = getattr(hf, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
    # DeepSeek-V2 renormalises only when it keeps more than one expert.
    return _routed_and_shared(hf, scoring, method, v3 or hf.num_experts_per_tok > 1)


def glm4_moe(hf: PretrainedConfig) -> MoESpec | None:
    return _routed_and_shared(hf, "sigmoid", "noaux_tc", True)


def _routed_and_shared(
    hf: PretrainedConfig, scoring: str, method: str, may_renormalise: bool
) -> MoESpec | None:
    """DeepSeek's MoE config fields, which GLM-4.5 shares."""
    if not getattr(hf, "n_routed_experts", None):
        return None
    return MoESpec(
        num_experts=hf.n_routed_experts,
        experts_field="n_routed_experts",
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        shared_intermediate_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0),
        scoring=scoring,
        topk_method=method,
        num_groups=hf.n_group or 1,
        topk_groups=hf.topk_group or 1,
        norm_topk_prob=bool(hf.norm_topk_prob) and may_renormalise,
        scaling=hf.routed_scaling_factor,
        first_dense=hf.first_k_dense_replace,
    )


def qwen3_moe(hf: PretrainedConfig) -> MoESpec | None:
    if not hf.num_experts:
        return None
    return MoESpec(
        num_experts=hf.num_experts,
        experts_field="num_experts",
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        shared_intermediate_size=0,
        scoring="softmax",
        topk_method="greedy",
        norm_topk_prob=bool(hf.norm_topk_prob),
        dense_layers=frozenset(hf.mlp_only_layers or ()),
        sparse_step=hf.decoder_sparse_step or 1,
    )


def gpt_oss_moe(hf: PretrainedConfig) -> MoESpec:
    return MoESpec(
        num_experts=hf.num_local_experts,
        experts_field="num_local_experts",
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.intermediate_size,
        shared_intermediate_size=0,
        scoring="topk_softmax",
        topk_method="greedy",
        router_bias=True,
        expert_bias=True,
        activation="swiglu_clamped",
        swiglu_alpha=hf.swiglu_alpha,
        swiglu_limit=hf.swiglu_limit,
        checkpoint="fused",
    )


FAMILIES: dict[str, Family] = {
    "deepseek_v2": Family(("DeepseekV2ForCausalLM",), "mla", deepseek_moe),
    "deepseek_v3": Family(("DeepseekV3ForCausalLM",), "mla", deepseek_moe),
    "deepseek_v32": Family(("DeepseekV32ForCausalLM",), "mla", deepseek_moe, sparse_attention=True),
    # Kimi-K2: DeepSeek-V3's architecture under its own config, which transformers reads only by
    # running the checkpoint's code: read here as DeepSeek-V3's.
    "kimi_k2": Family(("DeepseekV3ForCausalLM",), "mla", deepseek_moe, config_as="deepseek_v3"),
    "llama": Family(("LlamaForCausalLM",), "gqa"),
    "qwen3": Family(("Qwen3ForCausalLM",), "gqa", qk_norm=lambda hf: True),
    "qwen3_moe": Family(("Qwen3MoeForCausalLM",), "gqa", qwen3_moe, qk_norm=lambda hf: True),
    "glm4_moe": Family(
        ("Glm4MoeForCausalLM",),
        "gqa",
        glm4_moe,
        qk_norm=lambda hf: bool(hf.use_qk_norm),
        attention_bias="qkv",
    ),
    "gpt_oss": Family(
        ("GptOssForCausalLM",),
        "gqa",
        gpt_oss_moe,
        attention_bias="qkvo",
        sinks=True,
        quantizations=("mxfp4",),
    ),
}
SERVED = "dpserve serves " + "; ".join(f"{'/'.join(f.archs)} (model_type {t})" for t, f in FAMILIES.items())
