"""The model facts the engine needs, read from a Hugging Face config, and the shape checks
that decide whether a (tp, dp) layout can serve it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from dpserve.config import EngineConfig
from dpserve.eplb.placement import Placement, start_placement
from dpserve.layers.specs import PER_ROW, MoESpec, QuantSpec
from dpserve.models.checkpoint import CheckpointReader
from dpserve.models.family import FAMILIES, SERVED, Family


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
    family: str = ""  # config.json's model_type (kimi_k2 for Kimi-K2, whose hf config is DeepSeek-V3's)
    moe: MoESpec | None = None  # None: a dense model
    quant: QuantSpec | None = None  # how its linear weights are stored; None: in a float dtype

    @property
    def declaration(self) -> Family:
        return FAMILIES[self.family]

    @property
    def is_mla(self) -> bool:
        return self.declaration.attention == "mla"

    @classmethod
    def load(cls, model_path: str, quantization: str | None = None) -> ModelConfig:
        """The checkpoint's config; `quantization` (--quantization) names how its weights are kept
        when its quantization_config does not."""
        check_model_dir(model_path)
        hf, family = read_hf_config(model_path)
        arch = (hf.architectures or ["?"])[0]
        if family not in FAMILIES or arch not in FAMILIES[family].archs:
            raise ValueError(f"unsupported architecture {arch!r} (model_type {family!r}); {SERVED}")
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
            family=family,
            moe=FAMILIES[family].moe(hf),
            quant=read_quantization(model_path, hf, family, quantization),
        )

    def validate(self, cfg: EngineConfig) -> None:
        """Raises ValueError naming the numbers, and the layouts that would work, when the engine's
        layout cannot split this model."""
        self.check_layout(cfg)

    def check_layout(self, cfg: EngineConfig) -> None:
        """Raises ValueError naming the numbers, and the layouts that would work, when the engine's
        layout (tp, dp or replicas, expert parallelism) cannot split this model."""
        topo, replicas = cfg.rank_topology(0)[1], cfg.num_instances
        a, t = topo.attn_tp_size, topo.tp_size
        groups = f"{replicas} replicas" if replicas > 1 else f"dp={topo.dp_size}"
        layout = f"(tp={t}, {groups}, attention TP size {a})"
        heads_fit = [
            n
            for n in range(1, self.num_heads + 1)
            if self.num_heads % n == 0
            and (self.is_mla or self.num_kv_heads % n == 0 or n % self.num_kv_heads == 0)
        ]
        if a not in heads_fit:
            dps = [t // n for n in heads_fit if t % n == 0]
            hint = (
                f"; attention TP sizes (tp / dp with DP attention, tp without) this model takes: "
                f"{', '.join(map(str, heads_fit))}"
                + (f"; with tp={t}, DP attention works at dp in {dps}" if dps else "")
            )
            if self.num_heads % a:
                raise ValueError(
                    f"num_attention_heads={self.num_heads} is not divisible by {a} {layout}{hint}"
                )
            raise ValueError(
                f"num_key_value_heads={self.num_kv_heads} must divide or be divisible by {a} {layout}{hint}"
            )
        moe = self.moe
        if cfg.ep_size > 1 and moe is None:
            raise ValueError(f"ep_size={cfg.ep_size} splits routed experts, but {self.arch} has none")
        slots = moe.num_experts + cfg.ep_num_redundant_experts if moe else 0
        if cfg.ep_size > 1 and slots % cfg.ep_size:
            fits = [r for r in range(cfg.ep_size) if (moe.num_experts + r) % cfg.ep_size == 0]
            redundant = (
                f" + ep_num_redundant_experts={cfg.ep_num_redundant_experts}"
                if cfg.ep_num_redundant_experts
                else ""
            )
            raise ValueError(
                f"{moe.experts_field}={moe.num_experts}{redundant} is not divisible by ep_size={cfg.ep_size} "
                f"{layout}; redundant experts that spread evenly: {fits[0]} + a multiple of {cfg.ep_size}"
            )
        if cfg.ep_size > 1 and (cfg.ep_num_redundant_experts or cfg.init_expert_location or cfg.enable_eplb):
            self.expert_placement(cfg)  # the location file read and checked before any rank starts
        # What is split over the tp ranks: dense MLPs (unless replicated), each routed expert (TP
        # MoE), the shared experts (unless replicated beside all_to_all dispatch).
        sizes = {}
        if self.dense_layers and cfg.moe_dense_tp_size != 1:
            sizes["intermediate_size"] = self.hf.intermediate_size
        if moe and cfg.ep_size == 1:
            sizes["moe_intermediate_size"] = moe.intermediate_size
        if moe and cfg.moe_a2a_backend != "all_to_all":
            sizes["moe_intermediate_size * n_shared_experts"] = moe.shared_intermediate_size
        for name, size in sizes.items():
            if size % t:
                tps = [n for n in range(1, t + 1) if all(v % n == 0 for v in sizes.values())]
                raise ValueError(
                    f"{name}={size} is not divisible by tp_size={t} {layout}; tp sizes up to {t} that "
                    f"divide it: {', '.join(map(str, tps))}"
                )

    def expert_placement(self, cfg: EngineConfig) -> Placement:
        """The slots' experts an engine starts with in every MoE layer (EPLB: `--ep-num-redundant-
        experts`, `--init-expert-location`); an MTP layer's MoE takes its own row where the location
        file has one (recorded with NEXTN), else the last layer's."""
        spec = self.moe
        return start_placement(
            cfg.init_expert_location,
            self.num_layers - len(self.dense_layers),
            spec.num_experts,
            spec.num_experts + cfg.ep_num_redundant_experts,
            cfg.ep_size,
            cfg.nnodes,
            self.expert_groups,
            self.num_mtp_layers,
        )

    @property
    def expert_groups(self) -> int:
        """The routed experts' groups that group-limited routing keeps a row within (1: none)."""
        spec = self.moe
        return spec.num_groups if spec.topk_method in ("group_limited_greedy", "noaux_tc") else 1

    @property
    def dense_layers(self) -> list[int]:
        """The decoder layers whose MLP is dense."""
        return [i for i in range(self.num_layers) if self.moe is None or not self.moe.is_moe_layer(i)]

    def check_mtp(self) -> None:
        """Raises ValueError unless the checkpoint carries an MTP layer that NEXTN can draft with."""
        if self.num_mtp_layers < 1:
            raise ValueError(
                f"speculative_algorithm NEXTN drafts with the checkpoint's MTP layer, but {self.path} ({self.arch}) "
                f"has num_nextn_predict_layers={self.num_mtp_layers}; use a checkpoint with its MTP weights "
                "(DeepSeek-V3/R1/V3.2, GLM-4.5), or speculative_algorithm NGRAM"
            )
        name = f"model.layers.{self.num_layers}.eh_proj.weight"
        if name not in CheckpointReader(self.path).file_of:
            raise ValueError(
                f"{self.path}: config.json has num_nextn_predict_layers={self.num_mtp_layers} but the "
                f"checkpoint has no {name} (its MTP weights were left out)"
            )


SERVED_QUANTIZATION = (
    "dpserve serves unquantized checkpoints (float32, float16, bfloat16 safetensors), block-FP8 ones "
    "(quant_method fp8 with weight_block_size, DeepSeek-V3's format), W8A8-INT8 ones (SGLang's "
    "w8a8_int8: int8 weights with a scale per row), both kept 8-bit (--quantization fp8 or w8a8_int8 "
    "quantizes an unquantized one so at load), GGUF files and gpt-oss's MXFP4 experts (dequantized at load)"
)


ONLINE_FP8_BLOCK = (128, 128)  # --quantization fp8 on an unquantized checkpoint: DeepSeek-V3's blocks
INT8_PER_ROW = (1, PER_ROW)  # w8a8_int8: a scale per output row


def read_quantization(
    model_path: str, hf: PretrainedConfig, family: str, requested: str | None = None
) -> QuantSpec | None:
    """The checkpoint's quantization_config (or `requested`, --quantization) as dpserve serves it;
    ValueError naming what it is otherwise (loading quantized tensors without their scales would
    serve garbage without an error)."""
    quant = getattr(hf, "quantization_config", None)
    if not quant:  # int8 tensors read as stored, float ones quantized at load
        if requested == "w8a8_int8":
            return QuantSpec("w8a8_int8", INT8_PER_ROW, online=True)
        return QuantSpec("fp8", ONLINE_FP8_BLOCK, online=True) if requested == "fp8" else None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method", "?")
    if requested is not None and requested != method:
        raise ValueError(
            f"{model_path}: --quantization {requested}, but its quantization_config says quant_method={method!r}"
        )
    if method in FAMILIES[family].quantizations:
        return None  # dequantized by the family's own loading (gpt-oss's MXFP4 experts)
    if method == "w8a8_int8":
        return QuantSpec("w8a8_int8", INT8_PER_ROW)
    if method != "fp8":
        raise ValueError(
            f"{model_path}: quantization_config with quant_method={method!r} is not supported; {SERVED_QUANTIZATION}"
        )
    block, fmt = quant.get("weight_block_size"), quant.get("fmt", "e4m3")
    scheme = quant.get("activation_scheme", "dynamic")
    if not block or len(block) != 2 or fmt != "e4m3" or scheme != "dynamic":
        raise ValueError(
            f"{model_path}: FP8 with weight_block_size={block}, fmt={fmt!r}, activation_scheme={scheme!r} is not "
            f"supported (per-tensor or static FP8); {SERVED_QUANTIZATION}"
        )
    return QuantSpec("fp8", (int(block[0]), int(block[1])))


def read_hf_config(model_path: str | Path) -> tuple[PretrainedConfig, str]:
    """The checkpoint's transformers config and its family (config.json's model_type), without
    running code shipped with the checkpoint: a family read as another (`Family.config_as`) is read
    as the one it is built on (its `auto_map` ignored)."""
    raw = json.loads((Path(model_path) / "config.json").read_text())
    family = raw.get("model_type", "")
    config_as = FAMILIES[family].config_as if family in FAMILIES else ""
    if not config_as:
        try:
            return AutoConfig.from_pretrained(model_path, trust_remote_code=False), family
        except (ValueError, KeyError) as e:  # a model_type transformers does not know
            raise ValueError(
                f"{model_path}: model_type {family!r} is not one dpserve can read ({e}); {SERVED}"
            ) from None
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(config_as, **fields), family


def check_model_dir(model_path: str) -> None:
    """Raises ValueError, in one sentence saying what is accepted, unless `model_path` is a local
    Hugging Face directory (nothing is fetched from a model hub)."""
    accepted = (
        "--model-path takes a local Hugging Face directory (config.json and *.safetensors), a .gguf "
        "file, or smollm2-135m-instruct (the embedded model); nothing is downloaded from a model hub"
    )
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise ValueError(f"{model_path!r} is not a directory: {accepted}")
    if not (path / "config.json").is_file():
        raise ValueError(f"{model_path} has no config.json: {accepted}")


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
