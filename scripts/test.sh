#!/usr/bin/env bash
# Installs everything the tests need into .venv, lints and type-checks, and runs the default suite
# (unit + integration against real nats-server/etcd; slow benchmarks excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
# Real Prometheus and promtool (Debian's package) for the tests that check the alert rules, where apt can install them.
if ! command -v promtool >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; } \
    || echo "warning: could not install Debian's prometheus package; the promtool tests skip" >&2
fi
.venv/bin/ruff check services tests scripts
# Settings and the checked files are in pyproject.toml; the stubs install.sh generated are read, not checked.
.venv/bin/mypy
# Two test files at a time (PHALANX_TEST_WORKERS; 0 runs them in this process): a file's tests stay together, so a module's
# stack is started once. Most integration tests wait on leases, process starts and streams rather than the CPU.
.venv/bin/python -m pytest -n "${PHALANX_TEST_WORKERS:-2}" --dist loadfile -m "not slow and not compose" "$@"
# Then the live compose stack on its own (tests/deploy, marker compose): its image builds and 16 containers starved the tests
# that ran beside it (a 26-minute run with 3 timing failures). Arguments narrow the run above to what a developer asked for.
if [ $# -eq 0 ]; then
  exec .venv/bin/python -m pytest -m compose tests/deploy
fi
