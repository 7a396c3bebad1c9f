#!/usr/bin/env bash
# Installs everything the tests need into .venv, lints and type-checks, and runs the default suite
# (unit + integration against real nats-server/etcd; slow benchmarks excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
.venv/bin/ruff check services tests scripts
# Settings and the checked files are in pyproject.toml; the stubs install.sh generated are read, not checked.
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
