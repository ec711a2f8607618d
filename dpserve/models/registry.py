"""The model of a checkpoint under DP attention: its family's attention (MLA or GQA), shared MLP/MoE."""

from __future__ import annotations

from dpserve.attention.backend import AttentionBackend
from dpserve.attention.sdpa import SdpaBackend
from dpserve.config import EngineConfig
from dpserve.distributed import Groups
from dpserve.layers.dp_comm import DPComm
from dpserve.layers.quant import quantized_weights
from dpserve.models.base import CausalLM, DecoderLayer
from dpserve.models.config import ModelConfig
from dpserve.models.deepseek import build_deepseek_layers
from dpserve.models.gqa import build_gqa_layers
from dpserve.models.mtp import MTPLayer


def build_model(
    cfg: ModelConfig, groups: Groups, options: EngineConfig, backend: AttentionBackend | None = None
) -> CausalLM:
    """The model of `cfg` on this rank, shaped by the engine `options` that shape it: NEXTN's MTP
    layer (DeepSeek checkpoints that have one), MLA's prefill form, expert parallelism and the
    dispatch path, the DP LM head, replicated dense layers."""
    backend = backend or SdpaBackend()
    comm = DPComm(groups)
    mtp = options.nextn
    if mtp:
        cfg.check_mtp()
    with quantized_weights(cfg.quant):  # linear and expert weights kept as the checkpoint stores them
        if cfg.is_mla:
            pairs = build_deepseek_layers(cfg, groups, backend, options)
        else:
            pairs = build_gqa_layers(cfg, groups, backend, options)
        layers = [DecoderLayer(cfg, attn, mlp, comm) for attn, mlp in pairs]
        mtp_layer = MTPLayer(cfg, layers.pop()) if mtp else None
        return CausalLM(cfg, groups, comm, layers, backend, mtp_layer, options.enable_dp_lm_head)
