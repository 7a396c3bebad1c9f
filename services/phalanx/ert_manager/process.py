"""The ERT manager: one leader (etcd election) keeps the expert routing table in step with the live expert workers.

Why a process of its own rather than the health service's leader: the
table must change within milliseconds of an EW's lease lapsing, whatever
the health service is busy with (its check rounds take seconds and it
may itself be degraded), it is needed only by MoE deployments, and it is
small enough to run beside the EWs as a standby pair. Its failure domain is
its own: while no manager leads, AWs keep the table they have and still
replay around a dead EW on their own (worker/forwarding.py); only the
etcd copy lags.

Leader: list `/phalanx/v1/expert-workers/`, build the table (ert.ErtManager),
write it to `/phalanx/v1/moe/ert` (fenced by the leadership key), then apply
every registration put (join) and delete (lease lapsed or revoked: loss) and
write each new version. A new leader starts from the stored table's version,
so versions only grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from contextlib import aclosing
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from phalanx._proto import expert_pb2
from phalanx.common.config import EtcdConfig, TelemetryConfig
from phalanx.common.discovery import ExpertWorkerDirectory, decode_json, encode_json
from phalanx.common.leadership import LeaderElection, LeadershipLostError, lead_forever
from phalanx.common.lease import TRANSIENT_ERRORS, connect_etcd
from phalanx.common.service import ServiceShell
from phalanx.common.subjects import ERT_KEY, ERT_LEADER_KEY, validate_worker_id
from phalanx.ert_manager.config import ErtManagerConfig
from phalanx.ert_manager.table import ErtManager, ExpertRole, ExpertRoutingTable, ExpertWorkerJoined, ExpertWorkerLost, ExpertWorkerRef, HostedExpert
from phalanx.model.config import BUILTIN_MODELS, ModelConfig

log = logging.getLogger(__name__)


def moe_config(model: str) -> ModelConfig:
    """The shape of a built-in MoE or an HF Mixtral checkpoint, without loading weights."""
    config = BUILTIN_MODELS[model] if model in BUILTIN_MODELS else ModelConfig.from_hf_dir(Path(model))
    if not config.is_moe:
        raise ValueError(f"{config.name} is dense: there are no experts to place")
    return config


def joined(registration: expert_pb2.ExpertWorkerRegistration) -> ExpertWorkerJoined:
    ref = ExpertWorkerRef(registration.worker_id, registration.address, registration.channel_endpoint)
    hosted = tuple(HostedExpert(h.layer, h.expert, ExpertRole(h.role)) for h in registration.hosted)
    return ExpertWorkerJoined(ref, hosted)


async def read_table(client, key: str = ERT_KEY) -> ExpertRoutingTable | None:
    held = await client.get(key.encode())
    return None if held is None else ExpertRoutingTable.from_proto(decode_json(held.value, expert_pb2.ExpertRoutingTable))


class ErtManagerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.leader = Gauge("phalanx_ert_leader", "1 while this instance leads", registry=r)
        self.version = Gauge("phalanx_ert_version", "Version of the table last written", registry=r)
        self.expert_workers = Gauge("phalanx_ert_expert_workers", "Live expert workers in the table", registry=r)
        self.losses = Counter("phalanx_ert_expert_worker_losses", "Expert workers dropped from the table", registry=r)
        self.uncovered = Gauge("phalanx_ert_uncovered_experts", "Experts no live expert worker hosts", registry=r)


class ErtManagerProcess:
    def __init__(self, config: ErtManagerConfig, etcd: EtcdConfig, telemetry: TelemetryConfig) -> None:
        self.config = config
        self.etcd_config = etcd
        hostname = "".join(c if c.isalnum() or c in "_-" else "-" for c in socket.gethostname())
        self.instance_id = validate_worker_id(config.instance_id or f"ert-{hostname}-{os.getpid()}")
        self.metrics = ErtManagerMetrics()
        self.shell = ServiceShell("phalanx-ert-manager", config, telemetry, registry=self.metrics.registry)
        self.ready = self.shell.ready

    def request_stop(self) -> None:
        self.shell.request_stop()

    async def run(self) -> None:
        model = moe_config(self.config.model)
        async with self.shell as shell:
            await shell.start()
            client = connect_etcd(self.etcd_config)
            shell.push_async_callback(client.close)
            election = LeaderElection(self.etcd_config, ERT_LEADER_KEY, ttl_s=self.config.leader_ttl_s)
            election.attach(client)
            shell.push_async_callback(election.resign)
            await shell.set_serving(True)  # a standby serves too: it is ready to lead
            async with asyncio.TaskGroup() as tasks:
                leading = tasks.create_task(
                    lead_forever(election, f"ERT manager {self.instance_id}", self.instance_id.encode, lambda: self._lead(election, client, model))
                )
                await shell.wait_for_stop()
                leading.cancel()
            await shell.stop_server()

    async def _lead(self, election: LeaderElection, client, model: ModelConfig) -> None:
        """One leadership term: keep the table in step with the expert workers until deposed."""
        self.metrics.leader.set(1)
        directory = ExpertWorkerDirectory(self.etcd_config)
        try:
            stored = await read_table(client)
            manager = ErtManager(model.name, model.num_layers, model.num_experts, version=stored.version if stored else 0)
            log.info("ERT manager %s leads (stored table version %s)", self.instance_id, stored.version if stored else None)
            for registration in (await directory.list()).values():
                manager.apply(joined(registration))
            await self._write(election, manager)
            async with aclosing(directory.watch()) as events:
                async for kind, name, changed in events:
                    if kind == "put" and changed is not None:
                        table = manager.apply(joined(changed))
                    else:
                        table = manager.apply(ExpertWorkerLost(name))
                        if table is not None:
                            self.metrics.losses.inc()
                            log.warning("expert worker %s is gone; table version %d", name, table.version)
                    if table is not None:
                        await self._write(election, manager)
        finally:
            self.metrics.leader.set(0)
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await directory.close()

    async def _write(self, election: LeaderElection, manager: ErtManager) -> None:
        table = manager.table
        if not await election.fenced_put(ERT_KEY, encode_json(table.to_proto())):
            raise LeadershipLostError(f"a fenced write of the table (version {table.version}) was refused: another ERT manager leads")
        uncovered = table.num_layers * table.num_experts - sum(1 for loc in table.locations.values() if loc.primary)
        self.metrics.version.set(table.version)
        self.metrics.expert_workers.set(len(table.workers))
        self.metrics.uncovered.set(uncovered)
        log.info("ERT version %d: %d expert workers, %d experts uncovered", table.version, len(table.workers), uncovered)
