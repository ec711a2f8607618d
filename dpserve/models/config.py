"""The model facts the engine needs, read from a Hugging Face config, and the shape checks
that decide whether a (tp, dp) layout can serve it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from dpserve.distributed import Topology
from dpserve.models.checkpoint import CheckpointReader

MLA_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHS = (*MLA_ARCHS, "LlamaForCausalLM")


@dataclass
class ModelConfig:
    hf: PretrainedConfig
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    context_len: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    path: str = ""
    num_mtp_layers: int = 0  # DeepSeek's num_nextn_predict_layers: MTP layers after the decoder layers

    @property
    def is_mla(self) -> bool:
        return self.arch in MLA_ARCHS

    @classmethod
    def load(cls, model_path: str) -> ModelConfig:
        hf = AutoConfig.from_pretrained(model_path)
        arch = (hf.architectures or ["?"])[0]
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        quant = getattr(hf, "quantization_config", None)
        if quant:
            # Loading quantized tensors without their scales would serve garbage without an error.
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
            raise ValueError(
                f"{model_path}: quantization_config with quant_method={method!r} is not supported; dpserve "
                "runs unquantized checkpoints (float32, float16, bfloat16 safetensors) and GGUF files "
                "(dequantized at load). Dequantize the checkpoint first (DeepSeek-V3's FP8 weights: "
                "its fp8_cast_bf16.py)."
            )
        return cls(
            hf=hf,
            arch=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            rms_norm_eps=hf.rms_norm_eps,
            context_len=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(Path(model_path), hf),
            path=str(model_path),
            num_mtp_layers=getattr(hf, "num_nextn_predict_layers", None) or 0,
        )

    def validate(self, topo: Topology) -> None:
        """Raises ValueError naming the numbers when the layout cannot split this model."""
        a, t = topo.attn_tp_size, topo.tp_size
        layout = f"(tp={t}, dp={topo.dp_size}, attention TP size {a})"
        if self.num_heads % a:
            raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by {a} {layout}")
        if not self.is_mla and self.num_kv_heads % a and a % self.num_kv_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_kv_heads} must divide or be divisible by {a} {layout}"
            )
        sizes = {"intermediate_size": self.hf.intermediate_size}
        if self.is_mla and self.hf.n_routed_experts:
            sizes["moe_intermediate_size"] = self.hf.moe_intermediate_size
            sizes["moe_intermediate_size * n_shared_experts"] = self.hf.moe_intermediate_size * (
                self.hf.n_shared_experts or 0
            )
            if self.hf.first_k_dense_replace == 0:
                del sizes["intermediate_size"]
        for name, size in sizes.items():
            if size % t:
                raise ValueError(f"{name}={size} is not divisible by tp_size={t} {layout}")

    def check_mtp(self) -> None:
        """Raises ValueError unless the checkpoint carries an MTP layer that NEXTN can draft with."""
        if not self.is_mla or self.num_mtp_layers < 1:
            raise ValueError(
                f"speculative_algorithm NEXTN drafts with DeepSeek's MTP layer, but {self.path} ({self.arch}) "
                f"has num_nextn_predict_layers={self.num_mtp_layers}; use a DeepSeek-V3/R1 checkpoint with "
                "its MTP weights, or speculative_algorithm NGRAM"
            )
        name = f"model.layers.{self.num_layers}.eh_proj.weight"
        if name not in CheckpointReader(self.path, torch.float32).file_of:
            raise ValueError(
                f"{self.path}: config.json has num_nextn_predict_layers={self.num_mtp_layers} but the "
                f"checkpoint has no {name} (its MTP weights were left out)"
            )


def _eos_ids(model_path: Path, hf: PretrainedConfig) -> tuple[int, ...]:
    eos = None
    gen = model_path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
