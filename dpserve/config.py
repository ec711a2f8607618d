"""Engine configuration: one typed dataclass shared by the Python API and the CLI."""

from __future__ import annotations

from dataclasses import dataclass

from dpserve.distributed import Topology
from dpserve.memory import DEFAULT_MEM_FRACTION_STATIC

PADDING_MODES = ("auto", "sum_len", "max_len")
ATTENTION_BACKENDS = ("auto", "triton", "sdpa")
SPECULATIVE_ALGORITHMS = ("NEXTN", "NGRAM")
DEFAULT_CUDA_GRAPH_MAX_BS = 128


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The default decode buckets up to `max_bs`: 1, 2, 4, 8, then every multiple of 8, and max_bs."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return [*sizes, max_bs]


def cpu_has_native_bfloat16() -> bool:
    """AMX or AVX512-BF16: bfloat16 matmuls run natively, several times faster than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"amx_bf16", "avx512_bf16"})


@dataclass
class EngineConfig:
    """Everything an engine instance needs; validated on construction."""

    model_path: str
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = (
        "auto"  # auto: bfloat16 on cuda and on CPUs with native bfloat16 (AMX, AVX512-BF16), else float32
    )
    attention_backend: str = "auto"  # auto: triton on cuda, sdpa on cpu
    max_total_tokens: int | None = None  # KV pool size per DP rank; overrides the memory budget
    kv_cache_memory_gb: float | None = None  # KV budget per rank (GiB); default depends on device
    # GPU: fraction of the device's memory for weights + KV pool (+ the measured activation peak)
    mem_fraction_static: float = DEFAULT_MEM_FRACTION_STATIC
    max_running_requests: int = 256  # per DP rank
    chunked_prefill_size: int = 2048  # prefill tokens per step, per DP rank
    dp_padding_mode: str = "auto"  # sum_len, max_len, or auto: the cheaper of the two, chosen per step
    cuda_graph_max_bs: int = DEFAULT_CUDA_GRAPH_MAX_BS  # largest decode bucket (when cuda_graph_bs is unset)
    cuda_graph_bs: list[int] | None = None  # explicit decode buckets; overrides cuda_graph_max_bs
    disable_cuda_graph: bool = False  # decode eagerly without padding (on the CPU: no padded path)
    disable_radix_cache: bool = False  # no prefix cache: every prompt is prefilled whole
    # NEXTN: drafts by DeepSeek's MTP layer; NGRAM: by prompt lookup; verified in one step
    speculative_algorithm: str | None = None
    speculative_num_steps: int = 3  # draft tokens proposed per request and step (a chain)
    speculative_num_draft_tokens: int | None = None  # tokens verified per request: num_steps + 1 (chains)
    random_seed: int = 0
    dist_init_addr: str | None = None  # host:port of rank 0; a free local port by default
    nnodes: int = 1  # nodes the ranks are spread over; node 0 runs the front end
    node_rank: int = 0
    log_level: str = "warning"

    def __post_init__(self) -> None:
        from dpserve.models.gguf import resolve_model_path

        # A GGUF file or the packaged SmolLM2 alias becomes its cached Hugging Face conversion.
        self.model_path = resolve_model_path(self.model_path)
        tp, dp = self.tp_size, self.dp_size
        if tp < 1 or dp < 1:
            raise ValueError(f"tp_size and dp_size must be >= 1, got tp_size={tp}, dp_size={dp}")
        if self.enable_dp_attention and dp > tp:
            raise ValueError(f"dp_size={dp} must not exceed tp_size={tp} with DP attention")
        if self.enable_dp_attention and tp % dp != 0:
            raise ValueError(f"tp_size={tp} must be divisible by dp_size={dp} (attention TP = tp / dp)")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.world_size % self.nnodes != 0:
            raise ValueError(
                f"the {self.world_size} ranks (tp={tp} x {self.num_instances} instance(s)) cannot be "
                f"split evenly over nnodes={self.nnodes}"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr=HOST:PORT (node 0's address, reachable by all)")
        if self.dp_padding_mode not in PADDING_MODES:
            raise ValueError(f"dp_padding_mode must be one of {PADDING_MODES}, got {self.dp_padding_mode!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None:
            self.cuda_graph_bs = sorted(set(self.cuda_graph_bs))
            if not self.cuda_graph_bs or self.cuda_graph_bs[0] < 1:
                raise ValueError(f"cuda_graph_bs must list batch sizes >= 1, got {self.cuda_graph_bs}")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.speculative_algorithm is not None:
            self.speculative_algorithm = self.speculative_algorithm.upper()
            if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
                raise ValueError(
                    f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                    f"got {self.speculative_algorithm!r}"
                )
            if self.speculative_num_steps < 1:
                raise ValueError(f"speculative_num_steps must be >= 1, got {self.speculative_num_steps}")
            if self.speculative_num_draft_tokens is None:
                self.speculative_num_draft_tokens = self.speculative_num_steps + 1
            if self.speculative_num_draft_tokens != self.speculative_num_steps + 1:
                raise ValueError(
                    f"speculative_num_draft_tokens={self.speculative_num_draft_tokens} must be "
                    f"speculative_num_steps + 1 = {self.speculative_num_steps + 1} (chains, top-k 1)"
                )
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" or cpu_has_native_bfloat16() else "float32"
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16, bfloat16 or auto, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "sdpa"

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
