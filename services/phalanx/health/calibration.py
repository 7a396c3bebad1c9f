"""The canary expectations of each model version: computed on workers that pass, stored (fenced), handed out in turn.

A model version served by a registered worker and not calibrated yet wakes the loop; it asks up to
`calibration_workers` HEALTHY workers of that version each candidate prompt twice (health/canary.py judges
the runs), stores the calibration under `canary_key` and reports workers that disagreed with the majority
as failed checks. A failed calibration is retried after a pause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc

from phalanx._proto import common_pb2, worker_pb2
from phalanx.common.discovery import encode_json
from phalanx.common.subjects import canary_key
from phalanx.health.canary import (
    CANDIDATE_PROMPTS,
    CanaryFact,
    CanaryRun,
    calibrate,
    canary_facts,
    coarsest_dtype,
    worker_compute_dtype,
)
from phalanx.health.config import HealthConfig
from phalanx.health.metrics import HealthMetrics
from phalanx.health.state import CheckOutcome, FailureReason, Health
from phalanx.health.tracked import TrackedWorker

__all__ = ["Calibrator"]

log = logging.getLogger(__name__)
_CALIBRATION_RETRY_S = 5.0


class Calibrator:
    """Keeps `calibrations` (by model version) complete for the versions ``workers`` serve; run ``run()`` as a task."""

    def __init__(
        self, config: HealthConfig, metrics: HealthMetrics, workers: Mapping[str, TrackedWorker],
        fenced_put: Callable[[str, bytes], Awaitable[None]], on_dissent: Callable[[TrackedWorker, CheckOutcome], Awaitable[None]],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.workers = workers
        self._fenced_put = fenced_put
        self._on_dissent = on_dissent
        self.calibrations: dict[str, common_pb2.CanaryCalibration] = {}
        self.wake = asyncio.Event()  # set: a version may lack its calibration

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            versions = {w.registration.model_version for w in self.workers.values()} - set(self.calibrations)
            failed = False
            for version in sorted(versions):
                failed |= not await self.calibrate(version)
            if failed:
                await asyncio.sleep(_CALIBRATION_RETRY_S)
                self.wake.set()

    def next_case(self, w: TrackedWorker) -> common_pb2.CanaryCase | None:
        """The worker's next canary of its version's calibration, in turn (None while uncalibrated)."""
        calibration = self.calibrations.get(w.registration.model_version)
        if calibration is None or not calibration.cases:
            return None
        w.case_turn += 1
        return calibration.cases[w.case_turn % len(calibration.cases)]

    def recalibrate(self, model_version: str = "") -> None:
        """Forget stored expectations (one version or all) and calibrate again."""
        for version in [model_version] if model_version else list(self.calibrations):
            self.calibrations.pop(version, None)
        self.wake.set()

    async def calibrate(self, model_version: str) -> bool:
        """Compute and store the canary expectations of one model version on workers that pass; False to retry later."""
        candidates = [
            w for w in self.workers.values()
            if w.registration.model_version == model_version and w.tracker.health is Health.HEALTHY and not w.stopping
        ][: self.config.calibration_workers]
        if not candidates:
            return False
        model = candidates[0].registration.model
        facts = canary_facts(model)
        runs = await asyncio.gather(*(self._runs(w, facts) for w in candidates))
        result = calibrate(
            model_version, model, [r for rs in runs for r in rs],
            prompts_wanted=self.config.canary_prompts, min_margin=self.config.min_margin, margin_ulps=self.config.min_margin_ulps,
            compute_dtype=coarsest_dtype(worker_compute_dtype(w.registration) for w in candidates), facts=facts,
        )
        for worker_id, why in result.dissenters.items():
            w = self.workers.get(worker_id)
            if w is not None:
                await self._on_dissent(w, CheckOutcome.failed(FailureReason.TOKEN_MISMATCH, f"at calibration: {why}"))
        if result.calibration is None:
            self.metrics.calibrations.labels(outcome="failed").inc()
            log.warning("canary calibration of %s failed: %s", model_version, result.rejected)
            return False
        await self._fenced_put(canary_key(model_version), encode_json(result.calibration))
        self.calibrations[model_version] = result.calibration
        self.metrics.calibrations.labels(outcome="ok").inc()
        log.info(
            "calibrated %d canaries for %s on %s", len(result.calibration.cases), model_version, list(result.calibration.calibrated_on)
        )
        return True

    async def _runs(self, w: TrackedWorker, facts: tuple[CanaryFact, ...]) -> list[CanaryRun]:
        """Each candidate prompt twice: the model's known facts if it has any, else the generic prompts."""
        asks = [(f.prompt, f.tokens) for f in facts] or [(p, self.config.canary_max_tokens) for p in CANDIDATE_PROMPTS]
        runs: list[CanaryRun] = []
        for prompt, max_tokens in asks:
            for _ in range(2):
                try:
                    r = await w.stub.Canary(worker_pb2.CanaryRequest(text=prompt, max_tokens=max_tokens), timeout=self.config.check_timeout_s)
                except grpc.aio.AioRpcError as error:
                    log.info("calibration canary on %s failed: %s", w.registration.worker_id, error.code().name)
                    return runs
                runs.append(
                    CanaryRun(w.registration.worker_id, prompt, tuple(r.token_ids), tuple(r.top_logits), tuple(r.top_margins), r.text)
                )
        return runs
