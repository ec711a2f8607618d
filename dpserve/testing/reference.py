"""Hugging Face greedy references for parity tests."""

from __future__ import annotations

import contextlib
import functools
import random
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel, RepetitionPenaltyLogitsProcessor
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dpserve.models.config import read_hf_config
from dpserve.sampling_params import SamplingParams

NEAR_TIE = 1e-3  # top-2 logits closer than this make greedy argmax numerically ambiguous


@dataclass
class Reference:
    """Greedy continuation of one prompt."""

    output_ids: list[int]
    logprobs: list[float]  # log_softmax of the raw logits for the chosen token, per step
    compare_len: int  # leading steps safe to compare: up to the first near-tie or eos-suppressed step
    margins: list[float] = field(default_factory=list)  # top-2 logit gap per step (greedy references)


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
    model_dir: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    int8_activations: Int8Activations | None = None,
    near_tie: float = NEAR_TIE,
    kv_cache_dtype: torch.dtype | None = None,
) -> list[Reference]:
    """Greedy-decode each prompt alone (batch 1, no padding) with transformers in float32.
    `int8_activations`: W8A8-INT8's activation rounding (`Int8Activations`); `kv_cache_dtype`: an
    8-bit KV cache's rounding (`kv_cache_rounding`); steps whose top-2 logits are closer than
    `near_tie` end the comparison."""
    model = _load_model(str(Path(model_dir).resolve()))
    refs = []
    for prompt in prompts:
        with int8_activation_rounding(model, int8_activations), kv_cache_rounding(model, kv_cache_dtype):
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
        margins = top2.values[:, 0] - top2.values[:, 1]
        # min_new_tokens masks eos, so a step whose raw argmax is eos diverges from plain greedy.
        unsafe = ((margins < near_tie) | (top2.indices[:, 0] != new_ids)).nonzero()
        compare_len = int(unsafe[0]) if len(unsafe) else len(new_ids)
        refs.append(Reference(new_ids.tolist(), chosen.tolist(), compare_len, margins.tolist()))
    return refs


@dataclass(frozen=True)
class Int8Activations:
    """Which linears round their input as W8A8-INT8 does (per token to 127 levels of its largest
    magnitude, and back): every 2-d and 3-d weight (experts by their stacked tensor) whose name holds
    none of `keep`. A row-parallel weight whose name holds a key of `parts` is split over that many
    ranks, each rounding its own columns of the input."""

    keep: tuple[str, ...]
    parts: dict[str, int] = field(default_factory=dict)

    def parts_of(self, name: str) -> int:
        return next((n for key, n in self.parts.items() if key in name), 1)


@contextlib.contextmanager
def int8_activation_rounding(model: PreTrainedModel, rounding: Int8Activations | None) -> Iterator[None]:
    """While inside, F.linear on one of `model`'s int8 weights first rounds its input as `rounding` says."""
    if rounding is None:
        yield
        return
    quantized = {
        p.untyped_storage().data_ptr(): rounding.parts_of(name)
        for name, p in model.named_parameters()
        if p.dim() in (2, 3) and not any(k in name for k in rounding.keep)
    }
    linear = F.linear
    # transformers' experts as a loop of F.linear calls (its grouped_mm default calls no F.linear).
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "is_concatenated")}
    implementations = {k: c._experts_implementation for k, c in configs.items()}

    def rounded_linear(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        parts = quantized.get(weight.untyped_storage().data_ptr())
        if parts is not None:
            split = x.unflatten(-1, (parts, -1))
            amax = split.abs().amax(dim=-1, keepdim=True)
            levels = torch.round(split * torch.full_like(amax, 127).div(amax)).clamp(-127, 127)
            x = torch.where(amax > 0, levels * (amax / 127), split).flatten(-2)
        return linear(x, weight, bias)

    F.linear = rounded_linear
    for c in configs.values():
        c._experts_implementation = "eager"
    try:
        yield
    finally:
        F.linear = linear
        for k, c in configs.items():
            c._experts_implementation = implementations[k]


def round_rows_8bit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x with each row of its last dim stored as `dtype` codes of the row's largest magnitude scaled
    to the format's largest value, and read back."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.finfo(dtype).max, 1.0)
    return (x / scale).to(dtype).float() * scale


@contextlib.contextmanager
def kv_cache_rounding(model: PreTrainedModel, dtype: torch.dtype | None) -> Iterator[None]:
    """While inside, what `model` caches is rounded as an 8-bit KV cache of `dtype` stores it (None:
    unchanged): per token and KV head for keys and values (the eager attention's inputs, the cached
    rows included: rounding is idempotent), per token over the latent and rope key together for
    MLA (the inputs of transformers' `expand_kv`)."""
    if dtype is None:
        yield
        return
    mla = [m for m in model.modules() if hasattr(m, "expand_kv")]

    def eager(module, query, key, value, *args, **kwargs):
        forward = sys.modules[type(module).__module__].eager_attention_forward
        if module in mla:
            return forward(module, query, key, value, *args, **kwargs)
        return forward(
            module, query, round_rows_8bit(key, dtype), round_rows_8bit(value, dtype), *args, **kwargs
        )

    def rounded_expand(expand):
        def expand_kv(latent: torch.Tensor, k_rot: torch.Tensor):
            rows = round_rows_8bit(torch.cat([latent, k_rot], dim=-1), dtype)
            return expand(*rows.split([latent.shape[-1], k_rot.shape[-1]], dim=-1))

        return expand_kv

    for m in mla:
        m.expand_kv = rounded_expand(m.expand_kv)
    ALL_ATTENTION_FUNCTIONS["eager"] = eager
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["eager"]
        for m in mla:
            del m.expand_kv


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
