"""The `phalanx` command end to end: up (foreground and --detach), status, generate, down, as real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.testing.asserts import assert_eventually_sync

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "phalanx.cli"]
# Random weights that load at once; the default model is a real one that takes seconds.
TINY = "phalanx-tiny-moe"
# Everything that could point a command at some other stack than the one a test starts.
_FOREIGN_ENV = ("PHALANX_TARGET", "PHALANX_STATE_FILE", "PHALANX_NATS_URL", "PHALANX_ETCD_ENDPOINT", "PHALANX_API_KEY")
ENV = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV}


def phalanx(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=timeout, check=False)


def read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def stack_pids(state: dict) -> list[int]:
    pids = [state["supervisor_pid"], state["router_pid"], state["nats_pid"], state["etcd_pid"], *(w["pid"] for w in state["workers"])]
    return [pid for pid in pids if pid]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Exited but not yet reaped by its parent (init, for the detached supervisor) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_all_gone(pids: list[int]) -> None:
    assert_eventually_sync(lambda: all(gone(pid) for pid in pids), timeout=10, message=f"processes still alive: {pids}")


@pytest.fixture(scope="module")
def detached(tmp_path_factory):
    """One `phalanx up --detach` stack (own NATS and etcd, one worker) shared by the tests that only read it."""
    state_file = tmp_path_factory.mktemp("up") / "up.json"
    result = phalanx("up", "--detach", "--workers", "1", "--model", TINY, "--port", "0", "--state-file", str(state_file), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    state = read_state(state_file)
    assert state is not None and state["status"] == "ready"
    yield state_file, state, result.stdout
    if state_file.exists():  # a test failed before `phalanx down` ran
        phalanx("down", "--state-file", str(state_file))


def test_detached_up_prints_the_router_endpoint_and_records_every_process(detached):
    state_file, state, stdout = detached
    assert f"router {state['router_address']}" in stdout
    assert 'phalanx generate "Hello"' in stdout
    assert [w["worker_id"] for w in state["workers"]] == ["worker-0"]
    assert state["router_id"] == "router-0"
    assert state["nats_url"].startswith("nats://") and state["etcd_endpoint"]
    assert state["log_file"] == str(state_file.with_name("up.log"))
    assert all(not gone(pid) for pid in stack_pids(state))


def test_status_json_lists_the_worker_with_its_pid(detached):
    state_file, state, _ = detached
    result = phalanx("status", "--json", "--state-file", str(state_file))
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["router"] == state["router_address"]
    [worker] = status["workers"]
    assert worker["worker_id"] == "worker-0"
    assert worker["pid"] == state["workers"][0]["pid"]
    assert worker["health"] == "healthy"
    assert worker["total_blocks"] > 0


def test_status_table_names_the_worker(detached):
    state_file, state, _ = detached
    result = phalanx("status", "--target", state["router_address"])
    assert result.returncode == 0, result.stderr
    assert "worker-0" in result.stdout and str(state["workers"][0]["pid"]) in result.stdout


def test_generate_streams_text_through_the_router(detached):
    state_file, _, _ = detached
    result = phalanx("generate", "Hello", "--max-tokens", "8", "--state-file", str(state_file))
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout) > 1


def test_generate_reports_a_rejected_request_as_a_typed_error(detached):
    state_file, _, _ = detached
    result = phalanx("generate", "Hello", "--tier", "platinum", "--state-file", str(state_file))
    assert result.returncode == 1
    assert result.stderr.startswith("error: InvalidArgumentError: ")


def test_second_up_with_the_same_state_file_refuses(detached):
    state_file, state, _ = detached
    result = phalanx("up", "--workers", "1", "--model", TINY, "--port", "0", "--state-file", str(state_file))
    assert result.returncode == 1
    assert "already up" in result.stdout and "phalanx down" in result.stdout
    assert read_state(state_file)["supervisor_pid"] == state["supervisor_pid"]


def test_down_stops_every_process_and_removes_the_state_file(detached):
    # Last of the tests on the shared stack: it takes the stack down.
    state_file, state, _ = detached
    result = phalanx("down", "--state-file", str(state_file), timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped Phalanx" in result.stdout
    assert not state_file.exists()
    assert_all_gone(stack_pids(state))


def test_down_with_no_state_file_says_nothing_is_up(tmp_path):
    result = phalanx("down", "--state-file", str(tmp_path / "up.json"))
    assert result.returncode == 0
    assert "nothing is up" in result.stdout


def test_down_removes_a_state_file_whose_supervisor_is_gone(tmp_path):
    state_file = tmp_path / "up.json"
    # PID 1 is alive but no `phalanx up`: down must neither signal it nor trust the file.
    state_file.write_text(json.dumps({"supervisor_pid": 1, "status": "ready", "router_address": "127.0.0.1:1"}))
    result = phalanx("down", "--state-file", str(state_file))
    assert result.returncode == 0
    assert "nothing is up" in result.stdout
    assert not state_file.exists()


def test_up_fails_fast_when_the_router_port_is_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = phalanx("up", "--workers", "1", "--model", TINY, "--port", str(port), "--state-file", str(tmp_path / "up.json"))
    assert result.returncode == 1
    assert f"port {port} is taken" in result.stdout and "--port 0" in result.stdout
    assert not (tmp_path / "up.json").exists()


def start_foreground(tmp_path: Path, nats_server, etcd_server) -> tuple[subprocess.Popen, Path, dict]:
    """A foreground `phalanx up` on the session's NATS and etcd, returned once its state file says ready."""
    state_file = tmp_path / "up.json"
    log = open(tmp_path / "out.txt", "w")  # noqa: SIM115 - a file, not a pipe: nobody has to drain it
    process = subprocess.Popen(
        [*CLI, "up", "--workers", "1", "--model", TINY, "--port", "0", "--state-file", str(state_file),
         "--nats-url", nats_server.url, "--etcd-endpoint", etcd_server.endpoint],
        env=ENV, stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()

    def ready() -> dict | None:
        assert process.poll() is None, (tmp_path / "out.txt").read_text()
        state = read_state(state_file)
        return state if state and state["status"] == "ready" else None

    try:
        state = assert_eventually_sync(ready, timeout=90, interval=0.1)
    except BaseException:
        process.kill()
        process.wait(30)
        raise
    assert state["nats_pid"] is None and state["etcd_pid"] is None  # external: not ours to stop
    return process, state_file, state


def test_foreground_up_stops_everything_on_sigterm_and_exits_0(tmp_path, nats_server, etcd_server):
    process, state_file, state = start_foreground(tmp_path, nats_server, etcd_server)
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, (tmp_path / "out.txt").read_text()
    assert_all_gone(stack_pids(state))
    assert not state_file.exists()
    out = (tmp_path / "out.txt").read_text()
    assert out.index("stopped router-0") < out.index("stopped worker-0")
    assert nats_server.running and etcd_server.running


def test_foreground_up_exits_1_naming_a_process_that_died(tmp_path, nats_server, etcd_server):
    process, state_file, state = start_foreground(tmp_path, nats_server, etcd_server)
    worker_pid = state["workers"][0]["pid"]
    os.kill(worker_pid, signal.SIGKILL)
    assert process.wait(90) == 1
    out = (tmp_path / "out.txt").read_text()
    assert f"worker-0 (pid {worker_pid}) exited with signal SIGKILL" in out
    assert_all_gone(stack_pids(state))
    assert not state_file.exists()
