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
from dpserve.models.mtp import MTPLayer

LAYER_BUILDERS = {
    "DeepseekV2ForCausalLM": build_deepseek_layers,
    "DeepseekV3ForCausalLM": build_deepseek_layers,
    "LlamaForCausalLM": build_llama_layers,
}


def build_model(
    cfg: ModelConfig, groups: Groups, backend: AttentionBackend | None = None, mtp: bool = False
) -> CausalLM:
    """The model of `cfg`; `mtp`: with its MTP (NextN) layer (DeepSeek checkpoints that have one)."""
    backend = backend or SdpaBackend()
    comm = DPAttentionComm(groups)
    if mtp:
        cfg.check_mtp()
        pairs = build_deepseek_layers(cfg, groups.topo, backend, mtp=True)
    else:
        pairs = LAYER_BUILDERS[cfg.arch](cfg, groups.topo, backend)
    layers = [DecoderLayer(cfg, attn, mlp, comm) for attn, mlp in pairs]
    mtp_layer = MTPLayer(cfg, layers.pop()) if mtp else None
    return CausalLM(cfg, groups, comm, layers, backend, mtp_layer)
