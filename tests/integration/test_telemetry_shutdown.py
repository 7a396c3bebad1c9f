"""A service's stop is not held by a trace collector that never answers (compose and Helm run none by default)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"

# Spans for a collector that accepts the connection and then says nothing, then a stop.
SCRIPT = """
import sys, time
from phalanx.common.config import TelemetryConfig
from phalanx.common.telemetry import get_tracer, setup_telemetry, shutdown_telemetry
setup_telemetry("probe", TelemetryConfig(otlp_endpoint=sys.argv[1]))
for i in range(50):
    with get_tracer("probe").start_as_current_span(f"span-{i}"):
        pass
start = time.monotonic()
shutdown_telemetry()
print(round(time.monotonic() - start, 2))
"""


def test_shutdown_returns_within_its_bound_when_the_collector_hangs():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # accepts (the kernel does) and never speaks HTTP/2
        env = {**os.environ, "PYTHONPATH": str(SERVICES)}
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, f"http://127.0.0.1:{silent.getsockname()[1]}"],
            env=env, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        elapsed = time.monotonic() - start
    shutdown_s = float(done.stdout.split()[-1])
    assert shutdown_s < 3.5, f"shutdown_telemetry took {shutdown_s} s: {done.stderr[-2000:]}"
    assert elapsed < 30
    assert "did not finish within" in done.stderr  # the spans were really stuck, and the stop said so
