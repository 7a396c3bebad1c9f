"""`phalanx up --tls`: its own NATS and etcd serve mutual TLS too, with authorization: everything it started reaches them
with its own certificate and rights, a tenant's certificate gets nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aetcd.exceptions
import httpx
import pytest

from phalanx.client import Client, TlsConfig
from phalanx.common.config import EtcdConfig, NatsConfig
from phalanx.common.discovery import WorkerDirectory
from phalanx.common.events import EventBus
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "phalanx.cli"]
_FOREIGN = ("PHALANX_TARGET", "PHALANX_STATE_FILE", "PHALANX_NATS_URL", "PHALANX_ETCD_ENDPOINT", "PHALANX_API_KEY", "PHALANX_TLS_DIR")
ENV = {k: v for k, v in os.environ.items() if k not in _FOREIGN and not k.startswith(("PHALANX_ETCD_", "PHALANX_NATS_"))}


def phalanx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def tls_stack(tmp_path):
    state_file = tmp_path / "up.json"
    result = phalanx("up", "--detach", "--tls", "--engine", "sim", "--workers", "1", "--port", "0", "--gateway-port", "0",
                     "--state-file", str(state_file))
    assert result.returncode == 0, result.stdout + result.stderr
    try:
        yield json.loads(state_file.read_text())
    finally:
        down = phalanx("down", "--state-file", str(state_file), timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.mark.slow
async def test_up_tls_runs_nats_and_etcd_with_client_certificates(tls_stack):
    certs = Path(tls_stack["certs_dir"])
    assert tls_stack["nats_url"].startswith("tls://")
    endpoint = tls_stack["etcd_endpoint"]

    # The worker registered over TLS etcd (its own certificate); the admin certificate reads it.
    directory = WorkerDirectory(EtcdConfig(endpoint=endpoint, tls_dir=str(certs / "admin")))
    try:
        assert [w["worker_id"] for w in tls_stack["workers"]] == list(await directory.list())
    finally:
        await directory.close()
    # Without a certificate etcd and NATS refuse.
    plaintext = WorkerDirectory(EtcdConfig(endpoint=endpoint, request_timeout_s=2))
    try:
        with pytest.raises(aetcd.exceptions.ConnectionFailedError):
            await plaintext.list()
    finally:
        await plaintext.close()
    with pytest.raises(ConnectionError, match="certificate required"):
        await EventBus.connect(NatsConfig(url=tls_stack["nats_url"], ca_file=str(certs / "ca.crt"), startup_timeout_s=1.5), name="no-cert")
    bus = await EventBus.connect(NatsConfig(url=tls_stack["nats_url"], tls_dir=str(certs / "admin"), startup_timeout_s=5), name="admin")
    await bus.close()
    # A tenant's certificate (the CA's, but identity `client`) gets nothing from either: authorization is on.
    tenant = WorkerDirectory(EtcdConfig(endpoint=endpoint, tls_dir=str(certs / "client"), request_timeout_s=2))
    try:
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await tenant.list()
    finally:
        await tenant.close()
    with pytest.raises(ConnectionError, match="authorization refused this client's certificate"):
        await EventBus.connect(NatsConfig(url=tls_stack["nats_url"], tls_dir=str(certs / "client"), startup_timeout_s=5), name="tenant")

    # The stack serves: the router found the worker in etcd and its load over NATS.
    async with await Client.connect(tls_stack["router_address"], tls=TlsConfig.from_dir(certs / "client"), timeout=30) as client:
        completion = await client.complete([5, 6, 7, 8], max_tokens=6, ignore_eos=True)
    assert len(completion.token_ids) == 6

    # The gateway keeps its Responses in etcd with its own certificate and rights (the ACL's gateway row): a background
    # response is stored, relayed and read back. (The simulated workers' vocabulary is not the chat template's tokenizer's,
    # so the router refuses the prompt: the response ends failed, and says why.)
    async with httpx.AsyncClient(base_url=tls_stack["gateway_url"], timeout=60) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        created = await http.post("/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 4, "background": True})
        assert created.status_code == 200, created.text

        async def ended():
            stored = (await http.get(f"/v1/responses/{created.json()['id']}")).json()
            assert stored["status"] == "failed", stored
            return stored

        stored = await assert_eventually(ended, timeout=30)
    assert "vocabulary" in stored["error"]["message"]
