#!/usr/bin/env bash
# On the CPU machine (with network): the wheels the GPU machine lacks, for its Python 3.12, into
# scripts/wheels/ (ignored by git; well under the 64 MiB a device run carries). gpu_check.sh installs
# from there whichever of them is missing, with no network. The GPU machine brings its own torch,
# triton, transformers and their dependencies (numpy, safetensors, tokenizers, tqdm, ...).
#   bash scripts/gpu_wheels.sh && <device run, carrying scripts/wheels>: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")"
rm -rf wheels && mkdir wheels
# dpserve's own dependencies beyond torch and transformers, with theirs, resolved for Python 3.12.
PACKAGES=(pyzmq fastapi uvicorn pydantic gguf prometheus-client rich httpx)
python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d wheels "${PACKAGES[@]}"
ls wheels | wc -l | xargs echo "wheels:"
du -sh wheels
