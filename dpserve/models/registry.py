"""Model registry: architecture name -> builder of (attention, mlp) pairs per layer."""

from __future__ import annotations

from dpserve.attention.backend import AttentionBackend
from dpserve.attention.sdpa import SdpaBackend
from dpserve.distributed import Groups
from dpserve.layers.dp_attention import DPAttentionComm
from dpserve.models.base import CausalLM, DecoderLayer
from dpserve.models.config import ModelConfig
from dpserve.models.deepseek import build_deepseek_layers
from dpserve.models.llama import build_llama_layers

LAYER_BUILDERS = {
    "DeepseekV2ForCausalLM": build_deepseek_layers,
    "DeepseekV3ForCausalLM": build_deepseek_layers,
    "LlamaForCausalLM": build_llama_layers,
}


def build_model(cfg: ModelConfig, groups: Groups, backend: AttentionBackend | None = None) -> CausalLM:
    backend = backend or SdpaBackend()
    comm = DPAttentionComm(groups)
    pairs = LAYER_BUILDERS[cfg.arch](cfg, groups.topo, backend)
    layers = [DecoderLayer(cfg, attn, mlp, comm) for attn, mlp in pairs]
    return CausalLM(cfg, groups, comm, layers, backend)
