"""Offline generation with DP attention on a tiny random DeepseekV2 (written on first use).

python examples/offline.py [--tp 2] [--dp 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dpserve import Engine
from dpserve.testing.tiny_models import write_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="HF checkpoint; default: a tiny random DeepseekV2")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size (ranks)")
    parser.add_argument("--dp", type=int, default=2, help="DP attention groups")
    args = parser.parse_args()
    model = args.model_path
    if model is None:
        model = Path.home() / ".cache" / "dpserve" / "tiny-deepseek-v2"
        if not (model / "config.json").exists():
            write_tiny_model("deepseek_v2", model)
    with Engine(
        model_path=str(model), tp_size=args.tp, dp_size=args.dp, enable_dp_attention=args.dp > 1, device="cpu"
    ) as engine:
        print(engine.get_server_info())
        prompts = ["The quick brown fox", "Once upon a time", "The capital of France is"]
        outs = engine.generate(prompt=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0.0})
        for p, o in zip(prompts, outs, strict=True):
            print(f"dp_rank {o['meta_info']['dp_rank']}: {p!r} -> {o['text']!r}")


if __name__ == "__main__":
    main()
