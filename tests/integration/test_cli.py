"""The `phalanx` command end to end: up (foreground and --detach), status, generate, down, as real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.launch.infra import EtcdServer, NatsServer
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
    pids = [state["supervisor_pid"], state["router_pid"], state["nats_pid"], state["etcd_pid"], *(w["pid"] for w in state["workers"]),
            *(s["pid"] for s in state["services"])]
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
    result = phalanx(
        "up", "--detach", "--workers", "1", "--model", TINY, "--port", "0", "--gateway-port", "0", "--state-file", str(state_file), timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    state = read_state(state_file)
    assert state is not None and state["status"] == "ready"
    yield state_file, state, result.stdout
    if state_file.exists():  # a test failed before `phalanx down` ran
        phalanx("down", "--state-file", str(state_file))


def test_detached_up_prints_the_router_endpoint_and_records_every_process(detached):
    state_file, state, stdout = detached
    assert f"router {state['router_address']}" in stdout
    assert 'phalanx generate "The capital of France is"' in stdout and "phalanx chat" in stdout and "phalanx chaos kill worker-0" in stdout
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
    assert status["gateway_url"] == state["gateway_url"]  # the stack's gateway in front of that router ("" without one)
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


def test_chat_renders_each_turn_with_the_chat_template_and_streams_the_answer(detached):
    state_file, state, _ = detached
    chat = subprocess.run(
        [*CLI, "chat", "--max-tokens", "6", "--state-file", str(state_file)], input="Hi there\n\n", env=ENV, capture_output=True,
        text=True, timeout=60, check=False,
    )
    assert chat.returncode == 0, chat.stderr
    greeting, answer = chat.stdout.split("\n", 1)
    assert greeting.startswith(f"chatting with {state['model']} through {state['router_address']}")
    # The same turn as the raw prompt the model's template makes of it (ChatML for the built-in models), greedy: the same text.
    prompt = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    raw = phalanx("generate", prompt, "--max-tokens", "6", "--state-file", str(state_file))
    assert raw.returncode == 0, raw.stderr
    assert answer == f"> {raw.stdout}> "


def test_generate_reports_a_rejected_request_as_a_typed_error(detached):
    state_file, _, _ = detached
    result = phalanx("generate", "Hello", "--tier", "platinum", "--state-file", str(state_file))
    assert result.returncode == 1
    assert result.stderr.startswith("error: InvalidArgumentError: ")


def test_second_up_with_the_same_state_file_refuses(detached):
    state_file, state, _ = detached
    result = phalanx("up", "--workers", "1", "--model", TINY, "--port", "0", "--gateway-port", "0", "--state-file", str(state_file))
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
        result = phalanx(
            "up", "--workers", "1", "--model", TINY, "--port", str(port), "--gateway-port", "0", "--state-file", str(tmp_path / "up.json")
        )
    assert result.returncode == 1
    assert f"port {port} is taken" in result.stdout and "--port 0" in result.stdout
    assert not (tmp_path / "up.json").exists()


@pytest.fixture
def own_infra() -> Iterator[tuple[NatsServer, EtcdServer]]:
    """A NATS and an etcd for one test's stack: what its health service leaves in etcd (the degradation level) must not reach the next test."""
    with NatsServer() as nats_server, EtcdServer() as etcd_server:
        yield nats_server, etcd_server


@pytest.fixture
def foreground(tmp_path, own_infra):
    """start_foreground on the test's own NATS and etcd; a supervisor the test left running is SIGKILLed (PDEATHSIG takes its children)."""
    nats_server, etcd_server = own_infra
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path, dict]:
        process, state_file, state = start_foreground(tmp_path, nats_server, etcd_server, *args, env=env)
        started.append(process)
        return process, state_file, state

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def start_foreground(
    tmp_path: Path, nats_server, etcd_server, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path, dict]:
    """A foreground `phalanx up` (one worker) on the session's NATS and etcd, returned once its state file says ready."""
    state_file = tmp_path / "up.json"
    log = open(tmp_path / "out.txt", "w")  # noqa: SIM115 - a file, not a pipe: nobody has to drain it
    process = subprocess.Popen(
        [*CLI, "up", "--workers", "1", "--model", TINY, "--port", "0", "--gateway-port", "0", "--state-file", str(state_file),
         "--nats-url", nats_server.url, "--etcd-endpoint", etcd_server.endpoint, *args],
        env={**ENV, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
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


def test_foreground_up_stops_everything_on_sigterm_and_exits_0(tmp_path, own_infra, foreground):
    nats_server, etcd_server = own_infra
    process, state_file, state = foreground()
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, (tmp_path / "out.txt").read_text()
    assert_all_gone(stack_pids(state))
    assert not state_file.exists()
    out = (tmp_path / "out.txt").read_text()
    assert out.index("stopped router-0") < out.index("stopped worker-0")
    assert nats_server.running and etcd_server.running


def test_a_killed_worker_and_router_are_replaced_while_the_stack_keeps_serving(tmp_path, foreground):
    process, state_file, state = foreground()
    unknown = phalanx("chaos", "kill", "worker-9", "--state-file", str(state_file))
    assert unknown.returncode == 1
    assert "no process 'worker-9'" in unknown.stderr and "worker-0" in unknown.stderr and "router-0" in unknown.stderr
    worker_pid = state["workers"][0]["pid"]
    killed = phalanx("chaos", "kill", "worker-0", "--state-file", str(state_file), timeout=150)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert f"sent SIGKILL to worker-0 (pid {worker_pid})" in killed.stdout
    assert "replaced it with worker-1 (pid " in killed.stdout
    after = read_state(state_file)
    assert [w["worker_id"] for w in after["workers"]] == ["worker-1"] and after["workers"][0]["pid"] != worker_pid

    router_pid = state["router_pid"]
    killed = phalanx("chaos", "kill", "router-0", "--state-file", str(state_file), timeout=150)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    after = read_state(state_file)
    assert after["router_address"] == state["router_address"] and after["router_pid"] not in (None, router_pid)

    killed = phalanx("chaos", "kill", "gateway-0", "--state-file", str(state_file), timeout=150)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    after = read_state(state_file)
    assert after["gateway_url"] == state["gateway_url"]

    generated = phalanx("generate", "Hello", "--max-tokens", "4", "--state-file", str(state_file))
    assert generated.returncode == 0, generated.stderr
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{after['gateway_url']}/v1", api_key="unused", max_retries=0) as client:
        [model] = client.models.list().data
        # OpenAI samples at temperature 1, and a sampled EOS would end it early: greedy, EOS ignored, is exactly 4 tokens
        completion = client.completions.create(
            model=model.id, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
    assert completion.usage.completion_tokens == 4
    status = phalanx("status", "--json", "--state-file", str(state_file))
    assert status.returncode == 0, status.stderr
    events = [e["what"] for e in json.loads(status.stdout)["supervisor"]["events"]]
    assert f"started to replace worker-0 (pid {worker_pid}), which exited with signal SIGKILL" in events
    assert f"started to replace router-0 (pid {router_pid}), which exited with signal SIGKILL" in events
    out = (tmp_path / "out.txt").read_text()
    assert f"worker-0 (pid {worker_pid}) exited with signal SIGKILL" in out and "stopping everything" not in out

    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, (tmp_path / "out.txt").read_text()
    assert_all_gone([*stack_pids(state), *stack_pids(after)])
    assert not state_file.exists()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def forked_worker(out: Path, fork_servers_ready: int, state_file: Path, supervisor: int) -> int:
    """Once ``fork_servers_ready`` fork servers said so, the PID of a worker-N that replaces a SIGKILLed one, checked forked."""
    assert_eventually_sync(lambda: out.read_text().count(") ready: imported in") >= fork_servers_ready, timeout=60)
    state = read_state(state_file)
    assert state is not None
    [worker] = state["workers"]
    killed = phalanx("chaos", "kill", worker["worker_id"], "--state-file", str(state_file), timeout=150)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    after = read_state(state_file)
    assert after is not None
    [replacement] = after["workers"]
    pid = replacement["pid"]
    # Forked (the command line it shows is its own, not the fork server's), and adopted: the supervisor's child.
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"phalanx\0worker\0--worker-id\0" + replacement["worker_id"].encode())
    assert parent(pid) == supervisor
    return pid


@pytest.mark.slow
def test_forked_workers_are_the_supervisors_children_and_a_killed_fork_server_is_replaced(tmp_path, foreground):
    process, state_file, state = foreground("--fork-workers")
    out = tmp_path / "out.txt"
    forks = {s["name"]: s["pid"] for s in state["services"]}["fork-server"]
    assert parent(forks) == process.pid
    first = forked_worker(out, 1, state_file, process.pid)

    killed = phalanx("chaos", "kill", "fork-server", "--state-file", str(state_file), timeout=150)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "replaced it with fork-server (pid " in killed.stdout
    assert not gone(first), "a killed fork server leaves the workers it forked serving"
    generated = phalanx("generate", "Hello", "--max-tokens", "4", "--state-file", str(state_file))
    assert generated.returncode == 0, generated.stderr
    second = forked_worker(out, 2, state_file, process.pid)  # from the new server
    after = read_state(state_file)
    assert after is not None
    status = phalanx("status", "--json", "--state-file", str(state_file))
    events = [e["what"] for e in json.loads(status.stdout)["supervisor"]["events"]]
    assert f"started to replace fork-server (pid {forks}), which exited with signal SIGKILL" in events

    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, out.read_text()
    assert "stopped fork-server (pid " in out.read_text()
    assert_all_gone([*stack_pids(state), *stack_pids(after), first, second])


def test_forked_workers_die_with_a_sigkilled_supervisor(tmp_path, foreground):
    process, state_file, state = foreground("--fork-workers")
    worker = forked_worker(tmp_path / "out.txt", 1, state_file, process.pid)
    after = read_state(state_file)
    assert after is not None
    process.kill()  # no clean-up runs: the parent-death signal, set once the worker was adopted, is all that stops it
    process.wait(30)
    assert_all_gone([*stack_pids(state), *stack_pids(after), worker])


@pytest.mark.slow
def test_up_failover_runs_each_slot_as_a_pair_and_restarts_a_dead_engine_as_the_new_shadow(tmp_path, foreground):
    process, state_file, state = foreground("--failover")
    engines = {w["worker_id"]: w for w in state["workers"]}
    assert set(engines) == {"worker-0-e0", "worker-0-e1"}
    assert engines["worker-0-e0"]["role"] == "primary" and engines["worker-0-e1"]["role"] == "shadow"
    assert "slot-0-memory" in {s["name"] for s in state["services"]}

    def engine_states() -> dict[str, tuple[str, str, int]]:
        status = phalanx("status", "--json", "--state-file", str(state_file))
        assert status.returncode == 0, status.stderr
        return {e["worker_id"]: (e["role"], e["state"], e["pid"]) for e in json.loads(status.stdout)["supervisor"]["engines"]}

    assert engine_states() == {
        "worker-0-e0": ("primary", "active", engines["worker-0-e0"]["pid"]),
        "worker-0-e1": ("shadow", "standby", engines["worker-0-e1"]["pid"]),
    }
    killed = phalanx("chaos", "kill", "worker-0-e0", "--state-file", str(state_file), timeout=150)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "replaced it with worker-0-e2 (pid " in killed.stdout

    def taken_over() -> bool:
        states = engine_states()
        return states.get("worker-0-e1", ("", "", 0))[1] == "active" and states.get("worker-0-e2", ("", "", 0))[1] == "standby"

    assert_eventually_sync(taken_over, timeout=30, interval=0.2)
    generated = phalanx("generate", "Hello", "--max-tokens", "4", "--state-file", str(state_file))
    assert generated.returncode == 0, generated.stderr
    status = json.loads(phalanx("status", "--json", "--state-file", str(state_file)).stdout)
    assert [w["worker_id"] for w in status["workers"]] == ["worker-0-e1"]  # the router sees the serving engine only

    after = read_state(state_file)
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, (tmp_path / "out.txt").read_text()
    assert_all_gone([*stack_pids(state), *stack_pids(after)])


def test_chaos_kill_with_nothing_up_says_so(tmp_path):
    result = phalanx("chaos", "kill", "worker", "--state-file", str(tmp_path / "none.json"))
    assert result.returncode == 1 and "nothing is up" in result.stderr


@pytest.mark.slow
def test_a_process_that_keeps_dying_at_start_up_stops_the_stack_naming_it(tmp_path, foreground):
    transformers = pytest.importorskip("transformers")
    checkpoint = tmp_path / "tiny-llama"
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(checkpoint)
    process, state_file, state = foreground(
        "--model", str(checkpoint),
        env={"PHALANX_UP_RESTART_BACKOFF_S": "0.1", "PHALANX_UP_CRASH_LOOP_LIMIT": "3"},
    )
    (checkpoint / "config.json").unlink()  # every replacement worker now fails to load the model
    os.kill(state["workers"][0]["pid"], signal.SIGKILL)
    assert process.wait(120) == 1, (tmp_path / "out.txt").read_text()
    out = (tmp_path / "out.txt").read_text()
    assert "worker-0 keeps failing at start-up (3 times in a row" in out
    # Why: the second replacement, like the first, exited before it served.
    assert "worker-1 exited with 1 before registering" in out and "last: worker-2 exited with 1 before registering" in out
    assert_all_gone(stack_pids(state))
    assert not state_file.exists()


@pytest.mark.slow
def test_up_with_expert_workers_serves_through_the_attention_role_and_replaces_a_killed_expert_worker(tmp_path, foreground):
    process, state_file, state = foreground("--attention-workers", "1", "--expert-workers", "2", "--shadow-experts", "1")
    assert {"ert-manager-0", "expert-0", "expert-1"} <= {s["name"] for s in state["services"]}
    command = [*CLI, "generate", "The lantern keeper", "--max-tokens", "12", "--state-file", str(state_file)]
    before = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=60, check=False)
    assert before.returncode == 0, before.stderr
    expert_pid = next(s["pid"] for s in state["services"] if s["name"] == "expert-0")
    killed = phalanx("chaos", "kill", "expert-0", "--state-file", str(state_file), timeout=150)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert f"sent SIGKILL to expert-0 (pid {expert_pid})" in killed.stdout and "replaced it with expert-0-r2 (pid " in killed.stdout
    after = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=60, check=False)
    assert after.returncode == 0 and after.stdout == before.stdout, after.stderr
    status = phalanx("status", "--json", "--state-file", str(state_file))
    assert status.returncode == 0, status.stderr
    roles = {p["name"]: (p["role"], p["pid"]) for p in json.loads(status.stdout)["supervisor"]["processes"]}
    assert {name: role for name, (role, _) in roles.items() if role in ("attention", "expert", "ert-manager")} == {
        "worker-0": "attention", "expert-0-r2": "expert", "expert-1": "expert", "ert-manager-0": "ert-manager",
    }
    assert all(pid > 0 for _, pid in roles.values())
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, (tmp_path / "out.txt").read_text()
    assert_all_gone([*stack_pids(state), *stack_pids(read_state(state_file) or state)])
    assert not state_file.exists()
