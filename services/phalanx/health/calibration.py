"""The canary expectations of each model version and compute dtype: computed on workers that pass, stored (fenced), handed
out in turn.

A group (model version, dtype) served by a registered worker and not calibrated yet wakes the loop; it asks up to
`calibration_workers` HEALTHY workers of that group each candidate prompt twice (health/canary.py judges
the runs), stores the calibration under `canary_key` and reports workers that disagreed with the majority
as failed checks. A failed calibration is retried after a pause. Dtypes calibrate apart: their greedy tokens
differ, and so do the margins a token needs to be steady.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc

from phalanx._proto import common_pb2, worker_pb2
from phalanx.common.discovery import encode_json
from phalanx.common.subjects import canary_key
from phalanx.health.canary import CANDIDATE_PROMPTS, CanaryFact, CanaryGroup, CanaryRun, calibrate, canary_facts
from phalanx.health.config import HealthConfig
from phalanx.health.metrics import HealthMetrics
from phalanx.health.state import CheckOutcome, FailureReason, Health
from phalanx.health.tracked import TrackedWorker

__all__ = ["Calibrator"]

log = logging.getLogger(__name__)
_CALIBRATION_RETRY_S = 5.0


class Calibrator:
    """Keeps `calibrations` (by model version and dtype) complete for the groups ``workers`` form; run ``run()`` as a task."""

    def __init__(
        self, config: HealthConfig, metrics: HealthMetrics, workers: Mapping[str, TrackedWorker],
        fenced_put: Callable[[str, bytes], Awaitable[None]], on_dissent: Callable[[TrackedWorker, CheckOutcome], Awaitable[None]],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.workers = workers
        self._fenced_put = fenced_put
        self._on_dissent = on_dissent
        self.calibrations: dict[CanaryGroup, common_pb2.CanaryCalibration] = {}
        self.wake = asyncio.Event()  # set: a group may lack its calibration

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            groups = {CanaryGroup.of_worker(w.registration) for w in self.workers.values()} - set(self.calibrations)
            failed = False
            for group in sorted(groups):
                failed |= not await self.calibrate(group)
            if failed:
                await asyncio.sleep(_CALIBRATION_RETRY_S)
                self.wake.set()

    def next_case(self, w: TrackedWorker) -> common_pb2.CanaryCase | None:
        """The worker's next canary of its group's calibration, in turn (None while uncalibrated)."""
        calibration = self.calibrations.get(CanaryGroup.of_worker(w.registration))
        if calibration is None or not calibration.cases:
            return None
        w.case_turn += 1
        return calibration.cases[w.case_turn % len(calibration.cases)]

    def recalibrate(self, model_version: str = "") -> None:
        """Forget stored expectations (one version's, in every dtype, or all) and calibrate again."""
        for group in [g for g in self.calibrations if not model_version or g.model_version == model_version]:
            del self.calibrations[group]
        self.wake.set()

    async def calibrate(self, group: CanaryGroup) -> bool:
        """Compute and store the canary expectations of one group on workers that pass; False to retry later."""
        candidates = [
            w for w in self.workers.values()
            if CanaryGroup.of_worker(w.registration) == group and w.tracker.health is Health.HEALTHY and not w.stopping
        ][: self.config.calibration_workers]
        if not candidates:
            return False
        model = candidates[0].registration.model
        facts = canary_facts(model)
        runs = await asyncio.gather(*(self._runs(w, facts) for w in candidates))
        result = calibrate(
            group.model_version, model, [r for rs in runs for r in rs],
            prompts_wanted=self.config.canary_prompts, min_margin=self.config.min_margin, margin_ulps=self.config.min_margin_ulps,
            compute_dtype=group.compute_dtype, facts=facts,
        )
        for worker_id, why in result.dissenters.items():
            w = self.workers.get(worker_id)
            if w is not None:
                await self._on_dissent(w, CheckOutcome.failed(FailureReason.TOKEN_MISMATCH, f"at calibration: {why}"))
        if result.calibration is None:
            self.metrics.calibrations.labels(outcome="failed").inc()
            log.warning("canary calibration of %s in %s failed: %s", group.model_version, group.compute_dtype, result.rejected)
            return False
        await self._fenced_put(canary_key(group.model_version, group.compute_dtype), encode_json(result.calibration))
        self.calibrations[group] = result.calibration
        self.metrics.calibrations.labels(outcome="ok").inc()
        log.info(
            "calibrated %d canaries for %s in %s on %s", len(result.calibration.cases), group.model_version, group.compute_dtype,
            list(result.calibration.calibrated_on),
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
