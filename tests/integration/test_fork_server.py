"""phalanx.launch.fork_server: workers forked from a pre-imported server are the caller's children, with their exit codes.

The caller of ForkServer becomes a child subreaper, so each case runs in a supervisor process of its own (a script here),
not in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

SUPERVISOR = textwrap.dedent("""
    import asyncio, json, os, signal, sys, time
    from pathlib import Path
    from phalanx.common.config import EtcdConfig
    from phalanx.common.discovery import WorkerDirectory
    from phalanx.launch.fork_server import ForkServer

    server = ForkServer(preload=["phalanx.cli.main", "phalanx.worker.process", "phalanx.worker.simulated"], main="phalanx.cli")
    report = {"before_ready": server.spawn(["--help"], dict(os.environ)) is None}
    server.start()
    deadline = time.monotonic() + 60
    while not server.ready:
        assert time.monotonic() < deadline, "the fork server did not get ready"
        time.sleep(0.01)
    nats_url, etcd_endpoint = sys.argv[1:]
    child = server.spawn(
        ["worker", "--engine", "sim", "--model", "phalanx-tiny-moe", "--port", "0", "--nats-url", nats_url,
         "--etcd-endpoint", etcd_endpoint, "--log-level", "WARNING"],
        # Its environment, not the server's: it registers under the id this names.
        dict(os.environ, PHALANX_WORKER_WORKER_ID="w-forked", PHALANX_WORKER_METRICS_PORT="0"),
    )

    async def registered() -> bool:
        directory = WorkerDirectory(EtcdConfig(endpoint=etcd_endpoint))
        try:
            while time.monotonic() < deadline and child.poll() is None:
                entries = await directory.list()
                if "w-forked" in entries:
                    return entries["w-forked"].pid == child.pid
                await asyncio.sleep(0.05)
            return False
        finally:
            await directory.close()

    deadline = time.monotonic() + 30
    report["env"] = asyncio.run(registered())
    stat = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
    report["parent_is_me"] = int(stat[1]) == os.getpid()
    report["cmdline"] = Path(f"/proc/{child.pid}/cmdline").read_bytes().decode(errors="replace")
    report["running"] = child.poll()
    child.send_signal(signal.SIGTERM)
    report["terminated"] = child.wait(10)
    report["usage_error"] = server.spawn(["no-such-command"], dict(os.environ)).wait(30)
    server.process.kill()
    server.process.wait()
    report["after_server_died"] = server.spawn(["--help"], dict(os.environ)) is None
    print(json.dumps(report))
""")


def test_a_forked_worker_is_the_callers_child_with_its_own_command_line_environment_and_exit_code(nats_server, etcd_server):
    result = subprocess.run(
        [sys.executable, "-c", SUPERVISOR, nats_server.url, etcd_server.endpoint],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["before_ready"], "not started: the caller spawns instead"
    assert report["parent_is_me"], "re-parented to the subreaper that asked for it"
    assert report["cmdline"].startswith("phalanx\0worker\0--engine\0sim\0"), report["cmdline"]
    assert report["env"] and report["running"] is None
    assert report["terminated"] == 0, "a worker exits cleanly on SIGTERM, forked or not"
    assert report["usage_error"] == 2
    assert report["after_server_died"], "a dead server makes nothing: the caller spawns instead"
