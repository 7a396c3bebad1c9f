"""Secrets never reach logs, traces or metrics: a stack with a chaos token, router and gateway API keys and a TLS
router key, used rightly and wrongly, and every byte it logged, exported as spans or served on /metrics searched.

Every process logs at DEBUG into this test's captured stdout/stderr (the children inherit them); spans go to a real
OTLP collector here that keeps the raw export requests.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sys
import threading
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from phalanx._proto import chaos_pb2, chaos_pb2_grpc
from phalanx.client import AuthenticationError, Client, TlsConfig
from phalanx.launch.services import GatewayHandle, start_gateway
from phalanx.launch.stack import Stack
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile
from phalanx.testing.asserts import assert_eventually

pytestmark = pytest.mark.integration

MODEL = "phalanx-tiny-moe"
CHAOS_TOKEN = "chaos-secret-7f3a9c1e5b2d4f60"
ROUTER_KEY = "sk-router-secret-1c9e7a5b3d"
GATEWAY_KEY = "sk-gateway-secret-4b8f2e6a0c"
WRONG_KEY = "sk-wrong-guess-secret-9d1f3b"
TENANTS = json.dumps({"default": {}, "batch": {"max_streams": 1}})
DEBUG = ("--log-level", "DEBUG")  # the last --log-level given wins over the launcher's


class RawCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC endpoint that keeps every export request's bytes and its spans' names."""

    def __init__(self) -> None:
        self.exports: list[bytes] = []
        self.names: set[str] = set()
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            self.exports.append(request.SerializeToString())
            for resource_spans in request.resource_spans:
                for scope in resource_spans.scope_spans:
                    self.names.update(span.name for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _profile(path: Path) -> Path:
    prefill = [PrefillSample(isl=float(n), ttft_s=0.002 + n * 2e-6) for n in (16, 512, 2048)]
    decode = [DecodeSample(context=float(c), concurrency=float(k), itl_s=0.005) for c in (64, 2048) for k in (1, 8)]
    save_profile(build_profile(prefill, decode, model=MODEL), path)
    return path


def _tls_files(directory: Path) -> tuple[Path, Path, bytes]:
    """A self-signed certificate for localhost and its key; returns (cert file, key file, the key's PEM body line)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    cert_file, key_file = directory / "router.crt", directory / "router.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(pem)
    return cert_file, key_file, pem.splitlines()[1]  # a line of the key's base64 body


def _metrics(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        return reply.read().decode()


async def _use_everything(stack: Stack, gateway: GatewayHandle, tls_router_address: str, cert: bytes) -> None:
    """Right and wrong credentials at every door, a limit refusal and a chaos fault."""
    router = stack.routers[0]
    worker = stack.workers[0]
    async with await Client.connect(router.address, api_key=ROUTER_KEY, timeout=30) as client:
        assert len((await client.complete("with the right key", max_tokens=4, ignore_eos=True)).token_ids) == 4
    async with await Client.connect(router.address, api_key=WRONG_KEY, timeout=30) as client:
        with pytest.raises(AuthenticationError):
            await client.complete("with a wrong key", max_tokens=4)
    tls = TlsConfig(root_certificates=cert, server_name_override="localhost")
    async with await Client.connect(tls_router_address, tls=tls, timeout=30) as client:
        assert len((await client.complete("over TLS", max_tokens=3, ignore_eos=True)).token_ids) == 3
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=GATEWAY_KEY, max_retries=0, timeout=30) as oai:
        done = await oai.completions.create(model=f"sim:{MODEL}", prompt="through the gateway", max_tokens=4, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 4
        stream = await oai.chat.completions.create(
            model=f"sim:{MODEL}", messages=[{"role": "user", "content": "stream"}], max_tokens=4, stream=True
        )
        assert [chunk async for chunk in stream]
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=WRONG_KEY, max_retries=0, timeout=30) as oai:
        with pytest.raises(openai.AuthenticationError):
            await oai.completions.create(model=f"sim:{MODEL}", prompt="wrong key", max_tokens=4)
    async with httpx.AsyncClient(timeout=30) as http:  # a key in an odd scheme, and a bad body with a good key
        assert (await http.get(f"{gateway.url}/v1/models", headers={"authorization": f"Basic {WRONG_KEY}"})).status_code == 401
        reply = await http.post(f"{gateway.url}/v1/completions", headers={"authorization": f"Bearer {GATEWAY_KEY}"}, content=b"{")
        assert reply.status_code == 400
    async with grpc.aio.insecure_channel(worker.address) as channel:
        chaos = chaos_pb2_grpc.ChaosServiceStub(channel)
        await chaos.ListFaults(chaos_pb2.ListFaultsRequest(), metadata=(("authorization", f"Bearer {CHAOS_TOKEN}"),))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await chaos.ListFaults(chaos_pb2.ListFaultsRequest(), metadata=(("authorization", f"Bearer {WRONG_KEY}"),))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_no_secret_reaches_logs_traces_or_metrics_labels(nats_config, etcd_config, tmp_path, capfd):
    collector = RawCollector()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    telemetry = {"PHALANX_TELEMETRY_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    cert_file, key_file, key_line = _tls_files(tmp_path)
    stack = Stack(nats_config.url, etcd_config, model=MODEL)
    gateway: GatewayHandle | None = None
    scrapes: list[str] = []
    try:
        await stack.add_workers(
            1, "--engine", "sim", "--profile", str(_profile(tmp_path / "sim.npz")), *DEBUG,
            env={"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": CHAOS_TOKEN, **telemetry},
        )
        router_env = {
            "PHALANX_ROUTER_TENANTS": TENANTS, "PHALANX_ROUTER_API_KEYS": json.dumps({ROUTER_KEY: "default", GATEWAY_KEY: "batch"}),
            **telemetry,
        }
        router = await stack.add_router(*DEBUG, env=router_env)
        tls_router = await stack.add_router(
            *DEBUG, env={"PHALANX_ROUTER_TLS_CERT_FILE": str(cert_file), "PHALANX_ROUTER_TLS_KEY_FILE": str(key_file), **telemetry}
        )
        gateway = await start_gateway(router.address, *DEBUG, env={
            "PHALANX_GATEWAY_TENANTS": TENANTS, "PHALANX_GATEWAY_API_KEYS": json.dumps({GATEWAY_KEY: "batch"}), **telemetry,
        })
        await _use_everything(stack, gateway, tls_router.address, cert_file.read_bytes())
        # Spans of the router, the worker and the gateway have all arrived (exports are batched every 100 ms).
        await assert_eventually(lambda: {"router.route", "gateway.completions"} <= collector.names, timeout=15)
        for address in (router.metrics_address, tls_router.metrics_address, stack.workers[0].metrics_address, gateway.address):
            scrapes.append(await asyncio.to_thread(_metrics, address))
    finally:
        if gateway is not None:
            gateway.terminate()
        await asyncio.to_thread(stack.stop)  # shutdown logs count too
        otlp.stop(0)
    logs = capfd.readouterr()
    logged = logs.out + logs.err
    assert "DEBUG" in logged and "router.route" in collector.names  # the haystacks are not empty
    secrets = {"chaos token": CHAOS_TOKEN, "router key": ROUTER_KEY, "gateway key": GATEWAY_KEY, "wrong key": WRONG_KEY,
               "TLS private key": key_line.decode()}
    exported = b"".join(collector.exports)
    for what, secret in secrets.items():
        assert secret not in logged, f"the {what} is in a log"
        assert secret.encode() not in exported, f"the {what} is in an exported span"
        for scrape in scrapes:
            assert secret not in scrape, f"the {what} is in /metrics"


@pytest.mark.parametrize(
    ("command", "env"),
    [
        (["router", "--port", "0"], {"PHALANX_ROUTER_API_KEYS": json.dumps({ROUTER_KEY: "nobody"})}),
        (["gateway", "--port", "0"], {"PHALANX_GATEWAY_API_KEYS": json.dumps({GATEWAY_KEY: "nobody"})}),
        (["worker", "--engine", "sim"], {"PHALANX_WORKER_CHAOS_ENABLED": "true", "PHALANX_WORKER_CHAOS_TOKEN": "short-" + CHAOS_TOKEN[:9]}),
    ],
)
async def test_a_refused_setting_is_reported_without_the_secrets_beside_it(command, env):
    # pydantic quotes a refused model's whole input unless told not to: the keys and the token sat in that quote.
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.cli", *command, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    text = output.decode(errors="replace")
    assert process.returncode != 0 and "validation error" in text, text[-2000:]
    for secret in (ROUTER_KEY, GATEWAY_KEY, CHAOS_TOKEN[:9]):
        assert secret[:10] not in text, text[-2000:]  # pydantic shortens what it quotes to about 10 characters
