"""Hugging Face greedy references for parity tests."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

NEAR_TIE = 1e-3  # top-2 logits closer than this make greedy argmax numerically ambiguous


@dataclass
class Reference:
    """Greedy continuation of one prompt."""

    output_ids: list[int]
    logprobs: list[float]  # log_softmax of the raw logits for the chosen token, per step
    compare_len: int  # leading steps safe to compare: up to the first near-tie or eos-suppressed step


@functools.lru_cache(maxsize=8)
def _load_model(model_dir: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.inference_mode()
def hf_greedy_reference(
    model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int
) -> list[Reference]:
    """Greedy-decode each prompt alone (batch 1, no padding) with transformers in float32."""
    model = _load_model(str(Path(model_dir).resolve()))
    refs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_ids = out.sequences[0, len(prompt) :]
        logits = torch.cat(out.logits)  # raw (unprocessed) logits, [steps, vocab]
        chosen = torch.log_softmax(logits, dim=-1).gather(1, new_ids[:, None])[:, 0]
        top2 = logits.topk(2, dim=-1)
        near_tie = (top2.values[:, 0] - top2.values[:, 1]) < NEAR_TIE
        # min_new_tokens masks eos, so a step whose raw argmax is eos diverges from plain greedy.
        unsafe = (near_tie | (top2.indices[:, 0] != new_ids)).nonzero()
        compare_len = int(unsafe[0]) if len(unsafe) else len(new_ids)
        refs.append(Reference(new_ids.tolist(), chosen.tolist(), compare_len))
    return refs


def random_prompts(
    vocab_size: int, n: int, seed: int, min_len: int = 3, max_len: int = 40
) -> list[list[int]]:
    """``n`` random prompts of distinct lengths in ``[min_len, max_len]`` avoiding special ids 0..2."""
    rng = random.Random(seed)
    lengths = rng.sample(range(min_len, max_len + 1), n)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for length in lengths]
