"""Tiny random Hugging Face checkpoints for tests and CPU benchmarks.

Everything is written through ``transformers`` itself (config class + ``save_pretrained``) and the
tokenizer is trained offline with ``tokenizers``, so nothing is downloaded.

    python -m dpserve.testing.tiny_models --arch deepseek_v3 --out /tmp/tiny_v3
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
VOCAB_SIZE = 301  # deliberately not a multiple of 4 so the engine's vocabulary padding is exercised
# Weight std for hidden_size 64 (scaled by 1/sqrt(width) for wider models): large enough that random logits
# are well separated (few greedy near-ties) and generations vary instead of repeating one token.
INITIALIZER_RANGE = 0.2
NORM_WEIGHT_STD = 0.1  # norm weights are 1 + N(0, std) so that loading them is actually tested
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = """\
The sun rose over the quiet town, and the people went out to work in the fields.
A small dog ran down the road to meet the children who were walking to school.
She opened the window and the cool morning air filled the room with the smell of rain.
In the evening they sat by the fire, and the old man told stories about the sea.
We can find the answer if we read the question again and think about what it means.
The train was late, so he bought a cup of coffee and watched the birds on the roof.
Many years ago there was a king who lived in a castle on top of a green hill.
The king had three daughters, and each of them wanted to see the world beyond the river.
It is important to write clear code, to test it well, and to keep it simple.
Please tell me how many apples are in the basket and how much they cost.
The teacher asked the class to draw a map of the city with all of its streets and parks.
When the music started, everyone in the hall stood up and began to dance.
He said that he would come back in the morning, but nobody saw him again.
The library is open from nine in the morning until six in the evening on most days.
Water boils at one hundred degrees, and it turns to ice when it is cold enough.
They planted trees along the river, and after ten years the forest was full of life.
Do you know where the nearest station is? I need to catch the last train home.
The computer read the numbers, added them together, and printed the result on the screen.
Our team worked hard all week, and on Friday we finally finished the new project.
The moon was bright and the stars were shining over the mountains and the lake.
"""


def build_tokenizer(out_dir: str | Path) -> None:
    """Train a tiny byte-level BPE tokenizer on the built-in corpus and save it to ``out_dir``.

    Plain ``encode`` adds no special tokens; the chat template starts with ``<|bos|>``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    ).save_pretrained(str(out_dir))


_ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
_DEEPSEEK_V2 = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters=_ROPE_DEFAULT,
)
_DEEPSEEK_V3 = {k: v for k, v in _DEEPSEEK_V2.items() if k != "topk_method"} | dict(
    q_lora_rank=32,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "rope_theta": 10000.0,
    },
    rope_interleave=True,
    num_mtp_layers=0,  # no MTP weights are written
)
_DEEPSEEK_V2_MID = _DEEPSEEK_V2 | dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    intermediate_size=1024,
    moe_intermediate_size=128,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    num_hidden_layers=4,
)
_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    rope_parameters=_ROPE_DEFAULT,
)
_SPECS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM, _DEEPSEEK_V2),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, _DEEPSEEK_V3),
    "llama": (LlamaConfig, LlamaForCausalLM, _LLAMA),
    "deepseek_v2_mid": (DeepseekV2Config, DeepseekV2ForCausalLM, _DEEPSEEK_V2_MID),
}
ARCHS: tuple[str, ...] = tuple(_SPECS)


def write_tiny_model(
    arch: str, out_dir: str | Path, seed: int = 0, shard_size: str | int | None = None
) -> Path:
    """Write a tiny random float32 checkpoint (config, safetensors, tokenizer) and return its directory.

    ``shard_size`` is passed to ``save_pretrained`` as ``max_shard_size`` (e.g. ``"20KB"``) to get a
    sharded checkpoint with ``model.safetensors.index.json``.
    """
    if arch not in _SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert len(tokenizer) == VOCAB_SIZE
    special_ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config_cls, model_cls, kwargs = _SPECS[arch]
    init_std = INITIALIZER_RANGE * (64 / kwargs["hidden_size"]) ** 0.5
    config = config_cls(**kwargs, vocab_size=VOCAB_SIZE, initializer_range=init_std, **special_ids)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in model.state_dict().items():  # detached views of the parameters and buffers
        if name.endswith("norm.weight"):
            tensor.copy_(1.0 + NORM_WEIGHT_STD * torch.randn(tensor.shape, generator=generator))
        elif name.endswith("e_score_correction_bias"):  # non-zero so noaux_tc's bias term matters
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
    model.generation_config = GenerationConfig(**special_ids)
    save_kwargs: dict[str, Any] = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(str(out), **save_kwargs)
    return out


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description="Write a tiny random Hugging Face checkpoint.")
    parser.add_argument("--arch", required=True, choices=ARCHS, help="model architecture to write")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the random weights (default 0)")
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="shard the safetensors file at this size, e.g. 20KB (default: a single file)",
    )
    args = parser.parse_args()
    print(write_tiny_model(args.arch, args.out, seed=args.seed, shard_size=args.max_shard_size))


if __name__ == "__main__":
    main()
