"""The checkpoint's tokenizer, never by running code shipped with it: through transformers, or for
Kimi-K2's tiktoken tokenizer (`tiktoken.model` with `tokenizer_class: TikTokenTokenizer`, read by
its own `tokenization_kimi.py` elsewhere) converted to a fast byte-level BPE tokenizer here."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

# Kimi's split pattern (its tokenizer's pat_str): runs of Han characters apart, words with their
# case and contractions, up to three digits, punctuation runs, whitespace.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_SPECIAL_IDS = 256 + 2  # ids after the BPE ranks: named in added_tokens_decoder, else reserved


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the checkpoint at `model_path`; ValueError or OSError where there is none
    that reads without its own code."""
    path = Path(model_path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("tokenizer_class") == "TikTokenTokenizer" and (path / "tiktoken.model").is_file():
        return _tiktoken(path, config)
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)


def _tiktoken(path: Path, config: dict) -> PreTrainedTokenizerFast:
    ranks = {}
    for line in (path / "tiktoken.model").read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    named = {int(i): t["content"] for i, t in config.get("added_tokens_decoder", {}).items()}
    first = len(ranks)
    specials = [named.get(i, f"<|reserved_token_{i}|>") for i in range(first, first + KIMI_SPECIAL_IDS)]

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_: str) -> dict[bytes, int]:  # the file read above: no tiktoken package
            return ranks

    converted = Converter(str(path / "tiktoken.model"), pattern=KIMI_PATTERN, extra_special_tokens=specials)
    template = path / "chat_template.jinja"
    chat_template = config.get("chat_template") or (template.read_text() if template.is_file() else None)
    tokens = {
        k: (v["content"] if isinstance(v, dict) else v)
        for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (v := config.get(k)) is not None
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=converted.converted(),
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        **tokens,
    )
