"""Model registry: architecture name -> builder of (attention, mlp) pairs per layer."""

from __future__ import annotations

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


def build_model(cfg: ModelConfig, groups: Groups) -> CausalLM:
    comm = DPAttentionComm(groups)
    pairs = LAYER_BUILDERS[cfg.arch](cfg, groups.topo)
    return CausalLM(cfg, groups, comm, [DecoderLayer(cfg, attn, mlp, comm) for attn, mlp in pairs])
