"""gRPC shell of the health service: the leader answers from memory, a standby from etcd."""

from __future__ import annotations

import asyncio
import logging
import time

from phalanx._proto import common_pb2, health_pb2, health_pb2_grpc
from phalanx.common.discovery import EtcdDirectory, decode_json
from phalanx.common.errors import NotFoundError, UnavailableError
from phalanx.common.lease import TRANSIENT_ERRORS
from phalanx.common.subjects import CANARY_PREFIX, DEGRADATION_KEY, DEGRADATION_PREFIX, HEALTH_PREFIX
from phalanx.health.canary import CanaryGroup

log = logging.getLogger(__name__)
_RECALIBRATE_TIMEOUT_S = 60.0


class HealthServicer(health_pb2_grpc.HealthServiceServicer):
    def __init__(self, process) -> None:
        self._process = process

    async def ListWorkerHealth(self, request, context):
        p = self._process
        monitor = p.monitor
        response = health_pb2.ListWorkerHealthResponse(instance_id=p.instance_id, leader=monitor is not None)
        try:
            holder = await p.election.holder()
        except TRANSIENT_ERRORS as error:  # etcd away: answer with what we know
            log.warning("cannot read the health leader key, answering without leader_id: %s", error)
            holder = None
        if holder:
            response.leader_id = decode_json(holder, common_pb2.HealthLeader).instance_id
        if monitor is not None and monitor.ready:
            response.workers.extend(sorted(monitor.records(), key=lambda r: r.worker_id))
            if monitor.degradation is not None:
                response.degradation.CopyFrom(monitor.degradation)
            response.calibrations.extend(monitor.calibrations.values())
            return response
        response.workers.extend(sorted((await _list(p, HEALTH_PREFIX, common_pb2.WorkerHealthRecord)).values(), key=lambda r: r.worker_id))
        degradation = (await _list(p, DEGRADATION_PREFIX, common_pb2.DegradationState)).get(DEGRADATION_KEY.rsplit("/", 1)[1])
        if degradation is not None:
            response.degradation.CopyFrom(degradation)
        response.calibrations.extend((await _list(p, CANARY_PREFIX, common_pb2.CanaryCalibration)).values())
        return response

    async def Recalibrate(self, request, context):
        monitor = self._process.monitor
        if monitor is None:
            raise UnavailableError("this health instance is a standby; call the leader (see ListWorkerHealth.leader_id)", retry_after_s=1.0)
        served = {w.registration.model_version for w in monitor.workers.values()}
        if request.model_version and request.model_version not in served:
            # Nothing could ever calibrate it: waiting out the timeout would only hold the caller.
            raise NotFoundError(f"no registered worker serves model version {request.model_version!r}; serving: {sorted(served)}")
        monitor.recalibrate(request.model_version)
        deadline = time.monotonic() + _RECALIBRATE_TIMEOUT_S
        wanted = {
            CanaryGroup.of_worker(w.registration) for w in monitor.workers.values()
            if not request.model_version or w.registration.model_version == request.model_version
        }
        while not wanted <= set(monitor.calibrations):
            if time.monotonic() > deadline:
                missing = [f"{g.model_version} in {g.compute_dtype}" for g in sorted(wanted - set(monitor.calibrations))]
                raise UnavailableError(f"calibration of {missing} did not finish", retry_after_s=5.0)
            await asyncio.sleep(0.1)
        return health_pb2.RecalibrateResponse(calibrations=[monitor.calibrations[g] for g in sorted(wanted)])


async def _list(process, prefix: str, message_type):
    directory = EtcdDirectory(process.etcd_config, prefix=prefix, message_type=message_type)
    try:
        return await directory.list()
    finally:
        await directory.close()
