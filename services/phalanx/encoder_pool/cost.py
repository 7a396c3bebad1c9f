"""What encoding costs, learned from measured batches, and the backlog bound that turns it into backpressure.

No I/O: the pool reports each batch (modality, units, elapsed ms) and asks
for estimates. A unit is one image, one video frame or one 30 s audio chunk;
its cost is an exponentially weighted mean of batch time / units, so it
reflects the batch sizes the encoder has been running lately. Until a
modality has been measured, the priors are published reference figures
(ViT-L/14 at 336²: 5 ms per image, 1.6 ms per frame batched; Whisper-small:
85 ms per 30 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from phalanx.encoder_pool.errors import EncoderOverloadedError

__all__ = ["PRIOR_UNIT_MS", "Admission", "CostModel", "Modality"]


class Modality(Enum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


PRIOR_UNIT_MS: Mapping[Modality, float] = {Modality.IMAGE: 5.0, Modality.VIDEO: 1.6, Modality.AUDIO: 85.0}


class CostModel:
    """Per-modality milliseconds per unit: EWMA of measured batch time / units (the first measurement replaces the prior)."""

    def __init__(self, *, alpha: float = 0.2, priors: Mapping[Modality, float] = PRIOR_UNIT_MS) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._unit_ms = dict(priors)
        self._measured: set[Modality] = set()

    def unit_ms(self, modality: Modality) -> float:
        return self._unit_ms[modality]

    def measured(self, modality: Modality) -> bool:
        return modality in self._measured

    def observe(self, modality: Modality, units: int, elapsed_ms: float) -> None:
        if units <= 0 or elapsed_ms < 0:
            raise ValueError(f"cannot learn from {units} units in {elapsed_ms} ms")
        per_unit = elapsed_ms / units
        if modality in self._measured:
            per_unit = self.alpha * per_unit + (1 - self.alpha) * self._unit_ms[modality]
        self._unit_ms[modality] = per_unit
        self._measured.add(modality)

    def estimate_ms(self, units: Mapping[Modality, int]) -> float:
        return sum(self._unit_ms[m] * n for m, n in units.items())


@dataclass
class Admission:
    """Queued units per modality, their estimated time, and the bound past which new work is refused.

    ``admit`` before queueing a request's units, ``done`` as each batch
    finishes; ``backlog_ms`` is what the registration advertises and joint
    routing adds to an encoder's encode cost.
    """

    cost: CostModel
    max_backlog_ms: float
    max_queued_units: int

    def __post_init__(self) -> None:
        self.queued: dict[Modality, int] = dict.fromkeys(Modality, 0)

    @property
    def backlog_ms(self) -> float:
        return self.cost.estimate_ms(self.queued)

    @property
    def queued_units(self) -> int:
        return sum(self.queued.values())

    def admit(self, units: Mapping[Modality, int]) -> None:
        """Count `units` as queued, or raise EncoderOverloadedError (nothing counted) when they would pass a bound.

        An idle encoder takes any one request, however large, so a request
        bigger than the bound is slow rather than impossible.
        """
        wanted = sum(units.values())
        if self.queued_units:
            backlog = self.backlog_ms
            if backlog + self.cost.estimate_ms(units) > self.max_backlog_ms or self.queued_units + wanted > self.max_queued_units:
                # Retry once about what is queued now has drained.
                raise EncoderOverloadedError(
                    f"encoder backlog {backlog:.0f} ms ({self.queued_units} units) is full", retry_after_s=max(backlog / 1000, 0.05)
                )
        for modality, n in units.items():
            self.queued[modality] += n

    def done(self, modality: Modality, units: int) -> None:
        self.queued[modality] = max(0, self.queued[modality] - units)
