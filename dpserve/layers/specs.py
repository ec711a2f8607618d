"""What a model's layers are, as the model config declares them: its MoE (`MoESpec`) and how its
linear weights are stored (`QuantSpec`). Plain records, read by the front end to validate a
model before any rank starts, and by the layers that build them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PER_ROW = 1 << 40  # W8A8-INT8's block width: every column of a row shares its scale
FP8 = torch.float8_e4m3fn
INT8 = torch.int8


@dataclass(frozen=True)
class MoESpec:
    """What a family's MoE layers compute and which layers they are."""

    num_experts: int  # routed experts (logical)
    experts_field: str  # the config field that says so, for messages
    top_k: int
    intermediate_size: int  # one routed expert's
    shared_intermediate_size: int  # all shared experts together; 0: none
    scoring: str  # softmax | sigmoid over all experts; topk_softmax: softmax over the top-k logits
    topk_method: str  # greedy | group_limited_greedy | noaux_tc (sigmoid + correction bias)
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False  # the top-k weights renormalised to sum to 1
    scaling: float = 1.0  # routed_scaling_factor
    first_dense: int = 0  # layers before it are dense (DeepSeek's first_k_dense_replace)
    dense_layers: frozenset[int] = frozenset()  # dense anyway (Qwen's mlp_only_layers)
    sparse_step: int = 1  # every sparse_step-th layer is MoE (Qwen's decoder_sparse_step)
    router_bias: bool = False
    expert_bias: bool = False  # biases on gate/up and down
    activation: str = "silu"  # silu(gate) * up; swiglu_clamped: gpt-oss's (gate, up clamped to limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # How the checkpoint names its experts: per_expert (experts.{e}.gate_proj...; router "gate") or
    # fused (gpt-oss: experts.gate_up_proj [E, hidden, 2I] gate/up interleaved, experts.down_proj
    # [E, I, hidden], their biases; router "router").
    checkpoint: str = "per_expert"

    def is_moe_layer(self, index: int) -> bool:
        return (
            index >= self.first_dense
            and index not in self.dense_layers
            and (index + 1) % self.sparse_step == 0
        )

    @property
    def correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint's linear weights are kept: `method` (SGLang's --quantization names) with a
    scale per block of `block` (rows, columns), as stored or quantized at load (`online`:
    --quantization on a checkpoint whose weights are not)."""

    method: str  # fp8 | w8a8_int8
    block: tuple[int, int]
    online: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return FP8 if self.method == "fp8" else INT8

    @property
    def scale_suffix(self) -> str:
        """The scale tensor's name after its weight's: DeepSeek's inverse scales, SGLang's int8 ones."""
        return "_scale_inv" if self.method == "fp8" else "_scale"

    def describe(self) -> str:
        return "a scale per row" if self.block[1] == PER_ROW else f"blocks of {list(self.block)}"
