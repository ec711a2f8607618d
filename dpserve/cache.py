"""Where dpserve keeps what it builds once per machine: converted GGUF models, the compiled CPU
kernels, torch.compile's inductor cache, the dtype and CPU probes ($DPSERVE_CACHE, else
~/.cache/dpserve)."""

import os
from pathlib import Path


def cache_root() -> Path:
    """The directory every cache of dpserve lives under."""
    return Path(os.environ.get("DPSERVE_CACHE") or Path.home() / ".cache" / "dpserve")
