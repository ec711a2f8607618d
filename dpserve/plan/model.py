"""The model the planner plans for: a bundled config by name, a Hugging Face directory, or a config.json.

Bundled configs (`configs/<name>/config.json`) are written from the published architecture numbers
of each model's Hugging Face config, with the quantization_config of the checkpoint its publisher
ships (DeepSeek-V3/V3.2 and Kimi-K2: block FP8; GLM-4.5 and Qwen3 in bfloat16, their -FP8 variants
planned with --quantization fp8; gpt-oss's without its MXFP4 quantization_config: the planner counts
the experts at the engine's dtype).
"""

from __future__ import annotations

from pathlib import Path

from dpserve.models.config import ModelConfig

CONFIG_DIR = Path(__file__).parent / "configs"
BUNDLED = (
    "deepseek-v2-lite",
    "deepseek-v2",
    "deepseek-v3",
    "deepseek-v3.2",
    "deepseek-coder-v2-lite",
    "kimi-k2",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "glm-4.5",
    "glm-4.5-air",
    "gpt-oss-120b",
    "gpt-oss-20b",
    "smollm2-135m",
)


def resolve(model: str) -> str:
    """A directory holding config.json for `model` (a bundled name, a directory, a config.json file,
    or anything the engine's --model-path takes, such as smollm2-135m-instruct)."""
    if model in BUNDLED:
        return str(CONFIG_DIR / model)
    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        return str(path.parent)
    from dpserve.models.gguf import resolve_model_path

    return resolve_model_path(model)


def load(model: str, quantization: str | None = None) -> tuple[str, ModelConfig]:
    """`model`'s directory and config, its weights kept as `quantization` (--quantization) says."""
    path = resolve(model)
    return path, ModelConfig.load(path, quantization)
