"""Hugging Face greedy references for parity tests."""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, RepetitionPenaltyLogitsProcessor

from dpserve.models.config import read_hf_config
from dpserve.sampling_params import SamplingParams

NEAR_TIE = 1e-3  # top-2 logits closer than this make greedy argmax numerically ambiguous


@dataclass
class Reference:
    """Greedy continuation of one prompt."""

    output_ids: list[int]
    logprobs: list[float]  # log_softmax of the raw logits for the chosen token, per step
    compare_len: int  # leading steps safe to compare: up to the first near-tie or eos-suppressed step


@functools.lru_cache(maxsize=8)
def _load_model(model_dir: str) -> PreTrainedModel:
    """transformers' model of the checkpoint, its config read as the engine reads it (Kimi-K2's as
    DeepSeek-V3's, without the checkpoint's code)."""
    config, _ = read_hf_config(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    )
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


def reference_logits(
    logits: torch.Tensor, prompt: list[int], generated: list[int], params: SamplingParams, stop_ids: set[int]
) -> torch.Tensor:
    """What `params` make of one position's raw logits, the plain way, token by token: Hugging Face's
    repetition penalty over prompt and generated tokens, then OpenAI's frequency and presence
    penalties over the generated ones, the logit bias, and -inf for `stop_ids` while fewer than
    min_new_tokens were generated."""
    scores = logits.float().clone()[None]
    if params.repetition_penalty != 1:
        processor = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        scores = processor(torch.tensor([prompt + generated]), scores)
    scores = scores[0]
    for token, count in Counter(generated).items():
        scores[token] -= count * params.frequency_penalty + params.presence_penalty
    for token, bias in params.logit_bias.items():
        scores[token] += bias
    if len(generated) < params.min_new_tokens:
        for token in stop_ids:
            scores[token] = float("-inf")
    return scores


@torch.inference_mode()
def hf_sampling_reference(
    model_dir: str | Path, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...]
) -> Reference:
    """Greedy decoding of one prompt with transformers in float32, one position at a time, its
    logits changed by `reference_logits`; it stops as the engine does (EOS unless ignored, stop
    token ids, max_new_tokens). Steps are safe to compare up to the first near-tie of the changed
    logits."""
    model = _load_model(str(Path(model_dir).resolve()))
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    out, logprobs, compare_len = [], [], None
    while len(out) < params.max_new_tokens:
        raw = model(torch.tensor([prompt + out])).logits[0, -1].float()  # tiny models: no KV cache needed
        top2 = reference_logits(raw, prompt, out, params, stop_ids).topk(2)
        if compare_len is None and top2.values[0] - top2.values[1] < NEAR_TIE:
            compare_len = len(out)
        token = int(top2.indices[0])
        out.append(token)
        logprobs.append(float(raw.log_softmax(-1)[token]))
        if token in stop_ids:
            break
    return Reference(out, logprobs, len(out) if compare_len is None else compare_len)


def random_prompts(
    vocab_size: int, n: int, seed: int, min_len: int = 3, max_len: int = 40
) -> list[list[int]]:
    """``n`` random prompts of distinct lengths in ``[min_len, max_len]`` avoiding special ids 0..2."""
    rng = random.Random(seed)
    lengths = rng.sample(range(min_len, max_len + 1), n)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for length in lengths]
