"""The README's first steps, as a newcomer takes them: `phalanx up --detach` with the default (real) model,
a worker SIGKILLed and replaced, then answers from the CLI and from the official `openai` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")

CLI = [sys.executable, "-m", "phalanx.cli"]
_FOREIGN_ENV = ("PHALANX_TARGET", "PHALANX_STATE_FILE", "PHALANX_NATS_URL", "PHALANX_ETCD_ENDPOINT", "PHALANX_API_KEY")
ENV = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV}


def phalanx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=timeout, check=False)


def test_up_survives_a_killed_worker_and_answers_through_the_cli_and_the_openai_client(tmp_path):
    state_file = str(tmp_path / "up.json")
    up = phalanx("up", "--detach", "--port", "0", "--gateway-port", "0", "--state-file", state_file, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = json.loads((tmp_path / "up.json").read_text())
        assert state["model"] == "smollm2-135m-instruct" and len(state["workers"]) == 2
        assert f"openai   {state['gateway_url']}/v1" in up.stdout

        killed = phalanx("chaos", "kill", "worker-0", "--state-file", state_file, timeout=180)
        assert killed.returncode == 0, killed.stdout + killed.stderr
        assert "the supervisor replaced it with worker-2" in killed.stdout

        generated = phalanx("generate", "The capital of France is", "--max-tokens", "8", "--state-file", state_file)
        assert generated.returncode == 0, generated.stderr
        assert "Paris" in generated.stdout

        client = openai.OpenAI(base_url=f"{state['gateway_url']}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            stream=True, max_tokens=16, temperature=0,
        )
        answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert "Paris" in answer
    finally:
        down = phalanx("down", "--state-file", state_file, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def test_up_with_prefill_and_decode_workers_answers_through_a_kv_transfer(tmp_path):
    from phalanx.launch.services import metric_value, scrape
    from phalanx.testing.asserts import assert_eventually_sync

    state_file = str(tmp_path / "up.json")
    # Every prompt prefilled remotely, short ones too: the demo's prompt takes the disaggregated path.
    env = {**ENV, "PHALANX_ROUTER_DISAGG_MODE": "always", "PHALANX_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "1"}
    up = subprocess.run(
        [*CLI, "up", "--detach", "--prefill-workers", "1", "--decode-workers", "1", "--port", "0", "--gateway-port", "0",
         "--state-file", state_file],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert "tls      off: plaintext" in up.stdout, up.stdout  # said once, at start
    try:
        state = json.loads((tmp_path / "up.json").read_text())
        assert len(state["workers"]) == 2
        status = phalanx("status", "--json", "--state-file", state_file)
        assert status.returncode == 0, status.stderr
        assert sorted(w["role"] for w in json.loads(status.stdout)["workers"]) == ["decode", "prefill"]
        # The prefill worker (decode workers come first) is replaced by a prefill worker.
        killed = phalanx("chaos", "kill", "worker-1", "--state-file", state_file, timeout=180)
        assert killed.returncode == 0 and "the supervisor replaced it with worker-2" in killed.stdout, killed.stdout + killed.stderr

        def roles() -> list[str]:
            listed = phalanx("status", "--json", "--state-file", state_file)
            return sorted(w["role"] for w in json.loads(listed.stdout)["workers"]) if listed.returncode == 0 else []

        assert assert_eventually_sync(lambda: roles() == ["decode", "prefill"], timeout=30, interval=0.5)

        generated = phalanx("generate", "The capital of France is", "--max-tokens", "8", "--state-file", state_file)
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout.startswith(" Paris"), generated.stdout
        transfers = metric_value(scrape(state["router_metrics_address"]), "phalanx_router_disagg_transfers_total", outcome="ok")
        assert transfers == 1.0, transfers

        client = openai.OpenAI(base_url=f"{state['gateway_url']}/v1", api_key="unused", max_retries=0, timeout=120)
        completion = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=8, temperature=0)
        assert completion.choices[0].text.startswith(" Paris"), completion.choices[0].text
        transfers = metric_value(scrape(state["router_metrics_address"]), "phalanx_router_disagg_transfers_total", outcome="ok")
        assert transfers == 2.0, transfers
    finally:
        down = phalanx("down", "--state-file", state_file, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
