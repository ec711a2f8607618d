#!/usr/bin/env bash
# What only a GPU can check, as staged checks under 5 minutes on one GPU (scripts/gpu_check.py;
# the stages: scripts/gpu_stages.py). Uses the machine's own torch, triton and transformers, and
# installs only what is missing from the wheels scripts/gpu_wheels.sh prepared (no network).
# Without a GPU every stage prints SKIP and the script exits 0 in seconds.
#   bash scripts/gpu_check.sh [--stages kernels graphs ...]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d scripts/wheels ]; then
    missing=$(python - <<'PY'
import importlib.metadata, pathlib
for wheel in sorted(pathlib.Path("scripts/wheels").glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
PY
)
    if [ -n "$missing" ]; then
        echo "installing from scripts/wheels: $(echo "$missing" | xargs -n1 basename | tr '\n' ' ')"
        # shellcheck disable=SC2086
        python -m pip install -q --no-index --no-deps $missing
    fi
fi
python scripts/gpu_check.py "$@"  # each stage under its own timeout: 300 s in all on one GPU
