"""Tiny random Hugging Face checkpoints for tests and CPU benchmarks.

Everything is written through ``transformers`` itself (config class + ``save_pretrained``) and the
tokenizer is trained offline with ``tokenizers``, so nothing is downloaded.

    python -m dpserve.testing.tiny_models --arch deepseek_v3 --out /tmp/tiny_v3
    python -m dpserve.testing.tiny_models --arch deepseek_v3 --mtp --out /tmp/tiny_v3_mtp

``--mtp`` (or the arch key ``deepseek_v3_mtp``) adds DeepSeek's multi-token-prediction (NextN) layer the
way DeepSeek-V3 checkpoints carry it: ``num_nextn_predict_layers: 1`` in config.json and tensors under
``model.layers.{num_hidden_layers}.`` (see :func:`add_mtp_layer`). transformers' ``DeepseekV3ForCausalLM``
ignores them (it logs them as unexpected keys) and loads the main model unchanged.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GenerationConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dpserve.layers.quant import FP8_MAX

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
VOCAB_SIZE = 301  # deliberately not a multiple of 4 so the engine's vocabulary padding is exercised
# Weight std for hidden_size 64 (scaled by 1/sqrt(width) for wider models): large enough that random logits
# are well separated (few greedy near-ties) and generations vary instead of repeating one token.
INITIALIZER_RANGE = 0.2
NORM_WEIGHT_STD = 0.1  # norm weights are 1 + N(0, std) so that loading them is actually tested
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Each family's turn format (as its published chat template renders a conversation, without the
# system preambles), so that a server serving the family's tiny checkpoint renders its own template.
FAMILY_CHAT_TEMPLATES = {
    "gpt_oss": (  # harmony
        "{% for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}"
        "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
    ),
    "glm4_moe": (
        "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    ),
    "kimi_k2": (
        "{% for message in messages %}<|im_{{ 'user' if message['role'] == 'user' else message['role'] }}|>"
        "{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    ),
}

CORPUS = """\
The sun rose over the quiet town, and the people went out to work in the fields.
A small dog ran down the road to meet the children who were walking to school.
She opened the window and the cool morning air filled the room with the smell of rain.
In the evening they sat by the fire, and the old man told stories about the sea.
We can find the answer if we read the question again and think about what it means.
The train was late, so he bought a cup of coffee and watched the birds on the roof.
Many years ago there was a king who lived in a castle on top of a green hill.
The king had three daughters, and each of them wanted to see the world beyond the river.
It is important to write clear code, to test it well, and to keep it simple.
Please tell me how many apples are in the basket and how much they cost.
The teacher asked the class to draw a map of the city with all of its streets and parks.
When the music started, everyone in the hall stood up and began to dance.
He said that he would come back in the morning, but nobody saw him again.
The library is open from nine in the morning until six in the evening on most days.
Water boils at one hundred degrees, and it turns to ice when it is cold enough.
They planted trees along the river, and after ten years the forest was full of life.
Do you know where the nearest station is? I need to catch the last train home.
The computer read the numbers, added them together, and printed the result on the screen.
Our team worked hard all week, and on Friday we finally finished the new project.
The moon was bright and the stars were shining over the mountains and the lake.
"""


def build_tokenizer(out_dir: str | Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """Train a tiny byte-level BPE tokenizer on the built-in corpus and save it to ``out_dir``.

    Plain ``encode`` adds no special tokens; the default chat template (ChatML, as Qwen's) starts
    with ``<|bos|>``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    ).save_pretrained(str(out_dir))


_ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
_DEEPSEEK_V2 = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters=_ROPE_DEFAULT,
)
_DEEPSEEK_V3 = {k: v for k, v in _DEEPSEEK_V2.items() if k != "topk_method"} | dict(
    q_lora_rank=32,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "rope_theta": 10000.0,
    },
    rope_interleave=True,
    num_mtp_layers=0,  # no MTP weights are written
)
_DEEPSEEK_V2_MID = _DEEPSEEK_V2 | dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    intermediate_size=1024,
    moe_intermediate_size=128,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    num_hidden_layers=4,
)
_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    rope_parameters=_ROPE_DEFAULT,
)
# Qwen3: GQA whose head_dim is not hidden / heads, per-head RMSNorm on q and k. Qwen3-MoE adds softmax
# top-k routing renormalised over the k, no shared experts, and a dense layer among the MoE ones.
_QWEN3 = _LLAMA | dict(
    num_hidden_layers=3,
    head_dim=32,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
_QWEN3_MOE = _QWEN3 | dict(
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
)
# GLM-4.5: GQA with q/k/v biases, per-head q/k norm, rotary on the first half of each head; DeepSeek-V3's
# routing (sigmoid, correction bias, groups) with a shared expert and a dense first layer.
_GLM4_MOE = _QWEN3 | dict(
    attention_bias=True,
    use_qk_norm=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    num_mtp_layers=0,  # no MTP weights are written unless asked
)
# gpt-oss: GQA with biases on q/k/v/o, a sink logit per head, a sliding window (8 here, so prompts pass
# it) on every other layer, YaRN; a router with a bias, softmax over the top-k logits, experts with
# biases and the clamped SwiGLU, stored fused (gate/up interleaved) as transformers saves them.
_GPT_OSS = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
        "rope_theta": 150000.0,
    },
)
# DeepSeek-V3.2: V3 with the lightning indexer; index_topk 8, so prompts of a few dozen tokens are
# sparse; 16 indexer heads, so that no two keys tie on the index score (a sum of relus).
_DEEPSEEK_V32 = {
    k: v for k, v in _DEEPSEEK_V3.items() if k not in ("rope_interleave", "num_mtp_layers")
} | dict(
    index_topk=8,
    index_n_heads=16,
    index_head_dim=32,
)
# Kimi-K2: DeepSeek-V3's architecture, one expert group (no group limit), its own scaling factor;
# written as DeepSeek-V3 weights under Kimi's config.json (model_type kimi_k2, code in auto_map).
_KIMI_K2 = _DEEPSEEK_V3 | dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, n_routed_experts=16)
KIMI_AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}
_SPECS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM, _DEEPSEEK_V2),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, _DEEPSEEK_V3),
    "kimi_k2": (DeepseekV3Config, DeepseekV3ForCausalLM, _KIMI_K2),
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, _DEEPSEEK_V32),
    "llama": (LlamaConfig, LlamaForCausalLM, _LLAMA),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, _QWEN3),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, _QWEN3_MOE),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, _GLM4_MOE),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, _GPT_OSS),
    "deepseek_v2_mid": (DeepseekV2Config, DeepseekV2ForCausalLM, _DEEPSEEK_V2_MID),
}
MTP_ARCHS = {  # arch keys that are another arch plus an MTP layer
    "deepseek_v3_mtp": "deepseek_v3",
    "glm4_moe_mtp": "glm4_moe",
    "deepseek_v32_mtp": "deepseek_v32",
}
ARCHS: tuple[str, ...] = (*_SPECS, *MTP_ARCHS)


def write_tiny_model(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    shard_size: str | int | None = None,
    mtp: bool = False,
    router_skew: float = 0.0,
) -> Path:
    """Write a tiny random float32 checkpoint (config, safetensors, tokenizer) and return its directory.

    ``shard_size`` is passed to ``save_pretrained`` as ``max_shard_size`` (e.g. ``"20KB"``) to get a
    sharded checkpoint with ``model.safetensors.index.json``. ``mtp=True`` (DeepSeek-V3, V3.2 and
    GLM-4.5; implied by the arch keys of MTP_ARCHS) adds one randomly initialized MTP layer, see
    :func:`add_mtp_layer`. ``router_skew`` > 0 (models whose router has a correction bias: V3, V3.2,
    GLM-4.5, Kimi-K2) adds it to the bias of experts 0 and 1 of every MoE layer, so that they take
    most rows: a skewed expert load, as real routing has.
    """
    if arch in MTP_ARCHS:
        arch, mtp = MTP_ARCHS[arch], True
    if arch not in _SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if mtp and arch not in MTP_ARCHS.values():
        raise ValueError(f"MTP layers are written for {', '.join(MTP_ARCHS.values())} only, not {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, FAMILY_CHAT_TEMPLATES.get(arch, CHAT_TEMPLATE))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert len(tokenizer) == VOCAB_SIZE
    special_ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config_cls, model_cls, kwargs = _SPECS[arch]
    if mtp:
        kwargs = kwargs | {"num_mtp_layers": 1}  # saved as num_nextn_predict_layers
    init_std = INITIALIZER_RANGE * (64 / kwargs["hidden_size"]) ** 0.5
    config = config_cls(**kwargs, vocab_size=VOCAB_SIZE, initializer_range=init_std, **special_ids)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    _randomize_norms_and_biases(model.state_dict(), generator)
    if router_skew:
        biases = [t for name, t in model.state_dict().items() if name.endswith("e_score_correction_bias")]
        if not biases:
            raise ValueError(f"{arch}'s router has no correction bias to skew")
        for bias in biases:
            bias[:2] += router_skew  # the state dict's tensors share the model's storage
    model.generation_config = GenerationConfig(**special_ids)
    save_kwargs: dict[str, Any] = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(str(out), **save_kwargs)
    if mtp:
        add_mtp_layer(out, mtp_layer_state_dict(model, init_std, generator))
    if arch == "kimi_k2":  # as Moonshot ships it: a family transformers reads only by remote code
        config_path = out / "config.json"
        written = json.loads(config_path.read_text())
        config_path.write_text(
            json.dumps(written | {"model_type": "kimi_k2", "auto_map": KIMI_AUTO_MAP}, indent=2)
        )
    return out


def write_random_model(
    config: str, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Path:
    """Write a random checkpoint with a real model's architecture (a bundled planner config such as
    ``smollm2-135m``, or a directory holding config.json) and the tiny tokenizer, whose ids the
    model's vocabulary covers: for throughput and memory figures, which do not depend on the weights'
    values, where the real weights are out of reach (no network)."""
    from dpserve.plan.model import resolve

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    hf_config = AutoConfig.from_pretrained(resolve(config))
    if hf_config.vocab_size < len(tokenizer):
        raise ValueError(f"{config}: vocabulary {hf_config.vocab_size} < the tokenizer's {len(tokenizer)}")
    special_ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for key, value in special_ids.items():
        setattr(hf_config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    model.generation_config = GenerationConfig(**special_ids)
    model.save_pretrained(str(out))
    return out


def _randomize_norms_and_biases(state: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    for name, tensor in state.items():  # detached views of the parameters and buffers
        if name.endswith("norm.weight"):
            tensor.copy_(1.0 + NORM_WEIGHT_STD * torch.randn(tensor.shape, generator=generator))
        elif name.endswith((".bias", "_bias", "sinks")):  # non-zero, so that loading them matters
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))


class MtpLayer(torch.nn.Module):
    """DeepSeek-V3's MTP (NextN) module with its checkpoint names (relative to ``model.layers.{N}.``).

    ``enorm``/``hnorm`` [hidden], ``eh_proj`` [hidden, 2*hidden] applied to ``cat(enorm(emb), hnorm(h))``,
    a full decoder layer (its tensors sit directly under the prefix: ``self_attn.*``, ``mlp.*``, the two
    layer norms), ``shared_head.norm`` [hidden]; ``embed_tokens`` and ``shared_head.head`` are copies of the
    main model's embedding and LM head, as in DeepSeek's checkpoints. Layer index ``N`` is
    ``num_hidden_layers``, which is >= ``first_k_dense_replace``, so the MLP is MoE like the main model's.
    GLM-4.5's checkpoints carry the same module under the same names, with GLM's decoder layer: pass the
    family's decoder layer and norm classes.
    """

    def __init__(self, config: PretrainedConfig, layer_cls: type | None = None, norm_cls: type | None = None):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        layer_cls, norm_cls = layer_cls or DeepseekV3DecoderLayer, norm_cls or DeepseekV3RMSNorm
        if len(getattr(config, "mlp_layer_types", None) or ()) == config.num_hidden_layers:
            # V3.2's config lists each layer's MLP kind: the MTP layer's is MoE.
            config = copy.deepcopy(config)
            config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = norm_cls(hidden, eps=eps)
        self.hnorm = norm_cls(hidden, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer_cls(config, layer_idx=config.num_hidden_layers)
        self.shared_head_norm = norm_cls(hidden, eps=eps)

    def checkpoint_state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """The module's tensors under DeepSeek's checkpoint names (without the shared embedding/head)."""
        out = {}
        for name, tensor in self.state_dict().items():
            tensor = tensor.detach()
            if name.startswith("layer."):
                name = name.removeprefix("layer.")
            elif name.startswith("shared_head_norm."):
                name = "shared_head.norm." + name.removeprefix("shared_head_norm.")
            # transformers keeps the experts fused ([E, 2I, H] gate|up, [E, H, I] down) but saves them per
            # expert, as DeepSeek's checkpoints have them: experts.{e}.{gate,up,down}_proj.weight.
            if name == "mlp.experts.gate_up_proj":
                gate, up = tensor.chunk(2, dim=1)
                for e in range(tensor.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
                    out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e].contiguous()
            elif name == "mlp.experts.down_proj":
                for e in range(tensor.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e].contiguous()
            else:
                out[prefix + name] = tensor.contiguous()
        return out


def mtp_layer_state_dict(
    model: PreTrainedModel, init_std: float, generator: torch.Generator, mtp: MtpLayer | None = None
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one MTP layer for ``model``, keyed ``model.layers.{num_hidden_layers}.*``.

    Without ``mtp`` a new one is randomly initialized like the main model (weights N(0, init_std), norm
    weights 1 + N(0, 0.1), non-zero expert score bias); with ``mtp`` (e.g. a trained one) its weights are
    written. The embedding and LM head copies come from ``model``.
    """
    config = model.config
    if mtp is None:
        mtp = MtpLayer(config, type(model.model.layers[-1]), type(model.model.norm)).to(torch.float32)
        state = mtp.state_dict()
        with torch.no_grad():
            for tensor in state.values():
                if tensor.is_floating_point():
                    tensor.copy_(init_std * torch.randn(tensor.shape, generator=generator))
            _randomize_norms_and_biases(state, generator)
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors = mtp.checkpoint_state_dict(prefix)
    tensors[prefix + "embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    tensors[prefix + "shared_head.head.weight"] = model.get_output_embeddings().weight.detach().clone()
    return tensors


def quantize_experts_mxfp4(model_dir: str | Path, seed: int = 0) -> None:
    """Gives a tiny gpt-oss checkpoint random MXFP4 experts, stored as OpenAI ships them:
    ``experts.{gate_up,down}_proj_blocks`` [E, out, in / 32, 16] uint8 (two FP4 codes per byte) and
    ``_scales`` [E, out, in / 32] uint8 (powers of two from 2^-6 to 2^-4), with a ``quantization_config``
    naming mxfp4. Their bfloat16 tensors are removed; the biases stay."""
    out = Path(model_dir)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inner, outer = tensors.pop(name).shape  # transformers' [E, in, out]
        groups = inner // 32
        tensors[name + "_blocks"] = torch.randint(
            0, 256, (experts, outer, groups, 16), generator=g, dtype=torch.uint8
        )
        tensors[name + "_scales"] = torch.randint(
            123, 126, (experts, outer, groups), generator=g, dtype=torch.uint8
        )
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def dequantized_copy(model_dir: str | Path, out_dir: str | Path) -> Path:
    """A float32 copy of an MXFP4 gpt-oss checkpoint, dequantized by transformers' own function
    (the reference an engine reading the MXFP4 files must match)."""

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, out = Path(model_dir), Path(out_dir)
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    for blocks in [n for n in tensors if n.endswith("_blocks")]:
        name = blocks.removesuffix("_blocks")
        scales = tensors.pop(name + "_scales")
        tensors[name] = convert_moe_packed_tensors(tensors.pop(blocks), scales, dtype=torch.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj", "shared_head")


def is_quantized_linear(name: str, tensor: torch.Tensor, keep: tuple[str, ...] = UNQUANTIZED) -> bool:
    """Whether DeepSeek's FP8 checkpoints store this tensor quantized: every linear weight (attention,
    MLPs, experts, the MTP layer's projection) but the embeddings, the LM head, norms and routers
    (`keep`: the names kept unquantized)."""
    return tensor.dim() == 2 and name.endswith(".weight") and not any(k in name for k in keep)


def quantize_fp8(
    model_dir: str | Path, out_dir: str | Path, block: tuple[int, int], keep: tuple[str, ...] = UNQUANTIZED
) -> Path:
    """A copy of a checkpoint in DeepSeek-V3's block-FP8 format: each linear weight (but `keep`) as
    float8_e4m3fn with a float32 `weight_scale_inv` per block of `block` (rows, columns; edge blocks
    ragged), the block's largest magnitude mapped to 448, and `quantization_config` saying so."""
    b0, b1 = block

    def fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = w.shape
        scale = torch.empty(-(-rows // b0), -(-cols // b1))
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
                scale[i, j] = tile.abs().amax().clamp(min=1e-12) / FP8_MAX
                q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
        return q, scale

    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    return _quantized_copy(model_dir, out_dir, keep, fp8, "_scale_inv", config)


def quantize_int8(
    model_dir: str | Path, out_dir: str | Path, keep: tuple[str, ...] = UNQUANTIZED, config: bool = False
) -> Path:
    """A copy of a checkpoint in SGLang's W8A8-INT8 format (meituan's DeepSeek-R1-Channel-INT8): each
    linear weight (but `keep`) as int8 with a float32 `weight_scale` [out, 1], each row's largest
    magnitude mapped to 127; with no quantization_config, as those checkpoints ship (`config`: one
    saying quant_method w8a8_int8)."""

    def int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale

    quant = {"quant_method": "w8a8_int8", "activation_scheme": "dynamic"} if config else None
    return _quantized_copy(model_dir, out_dir, keep, int8, "_scale", quant)


def _quantized_copy(
    model_dir: str | Path,
    out_dir: str | Path,
    keep: tuple[str, ...],
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale_suffix: str,
    quantization_config: dict | None,
) -> Path:
    """A copy of a checkpoint with each linear weight (but `keep`) replaced by `quantize`'s (q, scale),
    the scale saved as the weight's name + `scale_suffix`, and `quantization_config` in config.json."""
    src, out = Path(model_dir), Path(out_dir)
    shutil.copytree(src, out)
    added: dict[str, str] = {}  # scale tensor -> its shard
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in [n for n, t in tensors.items() if is_quantized_linear(n, t, keep)]:
            tensors[name], tensors[name + scale_suffix] = quantize(tensors.pop(name).float())
            added[name + scale_suffix] = path.name
        save_file(tensors, str(path), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] |= added
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    if quantization_config is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def dequantized_8bit_copy(model_dir: str | Path, out_dir: str | Path) -> Path:
    """A float32 copy of a block-FP8 or W8A8-INT8 checkpoint, dequantized by DeepSeek's rule W[i, j] =
    q[i, j] * s[i // B0, j // B1] (each scale repeated over its block, ragged edges cut; int8: a block
    per row): the reference an engine reading the 8-bit files must match (transformers derives the
    block from the scales' grid, which misreads ragged blocks)."""
    src, out = Path(model_dir), Path(out_dir)
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    quant = config.pop("quantization_config", None) or {}
    b0, b1 = quant.get("weight_block_size", (1, 1 << 40))
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        scales = [
            n for n in tensors if n.endswith(("_scale_inv", "_scale")) and n.rsplit("_scale", 1)[0] in tensors
        ]
        for name in scales:
            scale, weight = tensors.pop(name), name.rsplit("_scale", 1)[0]
            q = tensors[weight]
            rows, cols = q.shape
            grid = scale.repeat_interleave(b0, 0)[:rows].repeat_interleave(min(b1, cols), 1)[:, :cols]
            tensors[weight] = q.float() * grid
        save_file(tensors, str(path), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {
            n: f for n, f in data["weight_map"].items() if not n.endswith(("_scale_inv", "_scale"))
        }
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def add_mtp_layer(model_dir: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add MTP tensors to a saved checkpoint and set ``num_nextn_predict_layers: 1`` in its config.json.

    Single-file checkpoints get them appended to ``model.safetensors`` (transformers reads only that file
    when there is no index); sharded ones get a new shard ``model-mtp.safetensors`` listed in the index.
    """
    out = Path(model_dir)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("num_mtp_layers", None)
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {name: t.to(torch.float32).contiguous() for name, t in tensors.items()}
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        shard = "model-mtp.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, shard))
        meta = index.setdefault("metadata", {})
        meta["total_size"] = int(meta.get("total_size", 0)) + sum(
            t.numel() * t.element_size() for t in tensors.values()
        )
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    else:
        path = out / "model.safetensors"
        save_file(load_file(str(path)) | tensors, str(path), metadata={"format": "pt"})


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description="Write a tiny random Hugging Face checkpoint.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--arch", choices=ARCHS, help="tiny model architecture to write (float32)")
    which.add_argument(
        "--config",
        help="instead, a real architecture at full size with random bfloat16 weights: a bundled planner "
        "config (e.g. smollm2-135m) or a directory holding config.json",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the random weights (default 0)")
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="shard the safetensors file at this size, e.g. 20KB (default: a single file)",
    )
    parser.add_argument("--mtp", action="store_true", help="add an MTP (NextN) layer (deepseek_v3 only)")
    parser.add_argument(
        "--router-skew",
        type=float,
        default=0.0,
        help="add this to the router's correction bias of experts 0 and 1 (V3-style routers): a skewed load",
    )
    args = parser.parse_args()
    if args.config:
        print(write_random_model(args.config, args.out, seed=args.seed))
        return
    print(
        write_tiny_model(
            args.arch, args.out, args.seed, args.max_shard_size, mtp=args.mtp, router_skew=args.router_skew
        )
    )


if __name__ == "__main__":
    main()
