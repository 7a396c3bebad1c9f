"""Injected faults, as the engine thread sees them: hang, slow steps, corrupt logits or weights.

Pure and thread-safe: the chaos servicer (event loop) injects and clears,
the engine thread consults. With nothing injected the engine pays one
attribute read per step (`FaultState.active`); the hooks below run only
while it is true. Faults that act outside the engine (dropped NATS or etcd)
are kept here too, so that one place lists and expires them, but they never
set `active`.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


if TYPE_CHECKING:
    from phalanx.model.transformer import Transformer

__all__ = [
    "DEFAULT_CORRUPT_SCALE",
    "DEFAULT_SLOW_STEP_S",
    "ENGINE_FAULTS",
    "CorruptTarget",
    "Fault",
    "FaultKind",
    "FaultState",
    "corrupted_layer",
]

DEFAULT_SLOW_STEP_S = 0.2
DEFAULT_CORRUPT_SCALE = 1.0
# Fixed, so that a corrupted worker gives the same wrong answers every time (as a bad GPU often does).
_NOISE_SEED = 0x5EED


class FaultKind(enum.IntEnum):
    # Values match phalanx.chaos.v1.FaultKind.
    CRASH = 1
    HANG = 2
    SLOW = 3
    CORRUPT = 4
    DROP_NATS = 5
    DROP_ETCD = 6

    @property
    def label(self) -> str:
        """Lower-case name, as in metrics and the CLI (``drop_nats``)."""
        return self.name.lower()


class CorruptTarget(enum.IntEnum):
    # Values match phalanx.chaos.v1.CorruptTarget.
    LOGITS = 1
    WEIGHTS = 2


ENGINE_FAULTS = frozenset({FaultKind.HANG, FaultKind.SLOW, FaultKind.CORRUPT})


@dataclass(frozen=True)
class Fault:
    """One injected fault. Times are wall-clock (for reports); `deadline` is on the state's monotonic clock."""

    kind: FaultKind
    injected_at: float
    expires_at: float = 0.0  # 0: until cleared
    slow_step_s: float = 0.0
    corrupt_target: CorruptTarget | None = None
    corrupt_scale: float = 0.0
    deadline: float = math.inf

    def expired(self, now: float) -> bool:
        return now >= self.deadline


def corrupted_layer(model: Transformer) -> int:
    """The decoder layer whose weights a WEIGHTS corruption changes: the middle one."""
    return model.config.num_layers // 2


class FaultState:
    """The faults injected into one worker, one per kind (injecting a kind again replaces it)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._faults: dict[FaultKind, Fault] = {}
        self._changed = threading.Condition()
        self._interrupted = False
        self._bias: torch.Tensor | None = None
        # Originals of the parameters a WEIGHTS corruption changed, and the fault that changed them.
        self._saved_weights: dict[str, torch.Tensor] = {}
        self._weights_fault: Fault | None = None
        # Read by the engine thread once per step, without the lock.
        self.active = False
        # Called (under the state's lock) with the faults after each change: an engine process mirrors them.
        self.on_change: Callable[[dict[FaultKind, Fault]], object] | None = None

    # -- the control side ------------------------------------------------------
    def inject(
        self,
        kind: FaultKind,
        *,
        slow_step_s: float = DEFAULT_SLOW_STEP_S,
        corrupt_target: CorruptTarget = CorruptTarget.LOGITS,
        corrupt_scale: float = DEFAULT_CORRUPT_SCALE,
        duration_s: float = 0.0,
    ) -> Fault:
        """Adds (or replaces) the fault of `kind`; a positive `duration_s` makes it expire by itself."""
        kind = FaultKind(kind)
        if kind is FaultKind.CRASH:
            raise ValueError("a crash is not a state: the process just dies")
        for name, value in (("slow_step_s", slow_step_s), ("corrupt_scale", corrupt_scale), ("duration_s", duration_s)):
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        now, wall = self._clock(), self._wall_clock()
        fault = Fault(
            kind=kind,
            injected_at=wall,
            expires_at=wall + duration_s if duration_s else 0.0,
            slow_step_s=slow_step_s if kind is FaultKind.SLOW else 0.0,
            corrupt_target=CorruptTarget(corrupt_target) if kind is FaultKind.CORRUPT else None,
            corrupt_scale=corrupt_scale if kind is FaultKind.CORRUPT else 0.0,
            deadline=now + duration_s if duration_s else math.inf,
        )
        with self._changed:
            self._faults[kind] = fault
            self._update()
        return fault

    def clear(self, kind: FaultKind | None = None) -> list[Fault]:
        """Removes the fault of `kind`, or every fault; returns those removed."""
        with self._changed:
            if kind is None:
                removed = list(self._faults.values())
                self._faults.clear()
            else:
                fault = self._faults.pop(FaultKind(kind), None)
                removed = [fault] if fault is not None else []
            self._update()
        return removed

    def replace(self, faults: dict[FaultKind, Fault]) -> None:
        """Takes over another FaultState's faults whole (an engine process mirrors its worker's, see engine_core.py)."""
        with self._changed:
            self._faults = dict(faults)
            self._update()

    def expire(self) -> list[Fault]:
        """Removes the faults whose duration has passed; returns them."""
        now = self._clock()
        with self._changed:
            removed = [f for f in self._faults.values() if f.expired(now)]
            for fault in removed:
                del self._faults[fault.kind]
            if removed:
                self._update()
        return removed

    def faults(self) -> list[Fault]:
        """The faults in force now (expired ones left out), in kind order."""
        now = self._clock()
        with self._changed:
            return sorted((f for f in self._faults.values() if not f.expired(now)), key=lambda f: f.kind)

    def get(self, kind: FaultKind) -> Fault | None:
        """The fault of `kind` if it is in force."""
        fault = self._faults.get(kind)
        return None if fault is None or fault.expired(self._clock()) else fault

    def interrupt(self) -> None:
        """The engine is stopping: hangs and slow steps end now, and for good."""
        with self._changed:
            self._interrupted = True
            self._changed.notify_all()

    def _update(self) -> None:
        # Weights still corrupted keep the engine hook on until it restored them.
        self.active = any(kind in ENGINE_FAULTS for kind in self._faults) or self._weights_fault is not None
        self._changed.notify_all()
        if self.on_change is not None:
            self.on_change(dict(self._faults))

    # -- the engine thread -----------------------------------------------------
    def hold(self) -> None:
        """Blocks while a HANG is in force: until it is cleared, expires, or the engine stops."""
        with self._changed:
            while not self._interrupted:
                fault = self._faults.get(FaultKind.HANG)
                if fault is None:
                    return
                remaining = fault.deadline - self._clock()
                if remaining <= 0:
                    return
                self._changed.wait(None if remaining == math.inf else remaining)

    def slow_down(self) -> None:
        """Sleeps SLOW's slow_step_s (cut short if it is cleared or the engine stops)."""
        fault = self.get(FaultKind.SLOW)
        if fault is None or fault.slow_step_s <= 0:
            return
        with self._changed:
            self._changed.wait_for(lambda: self._interrupted or self._faults.get(FaultKind.SLOW) is not fault, fault.slow_step_s)

    def corrupt_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, vocab] plus a fixed random vector x scale x each row's std, under a LOGITS corruption."""
        fault = self.get(FaultKind.CORRUPT)
        if fault is None or fault.corrupt_target is not CorruptTarget.LOGITS:
            return logits
        import torch

        bias = self._bias
        if bias is None or bias.shape[-1] != logits.shape[-1]:
            bias = self._bias = torch.randn(logits.shape[-1], generator=torch.Generator().manual_seed(_NOISE_SEED))
        bias = bias.to(device=logits.device, dtype=logits.dtype)
        return logits + bias * (fault.corrupt_scale * logits.std(dim=-1, keepdim=True))

    def sync_weights(self, model: Transformer) -> bool:
        """Applies or restores a WEIGHTS corruption in place, on the thread that runs the model; True if weights changed.

        KV computed with the other weights is stale then: the caller drops its prefix cache.
        """
        fault = self.get(FaultKind.CORRUPT)
        wanted = fault if fault is not None and fault.corrupt_target is CorruptTarget.WEIGHTS else None
        if wanted is self._weights_fault:
            return False
        import torch

        with torch.no_grad():
            if self._weights_fault is not None:
                params = dict(model.named_parameters())
                for name, original in self._saved_weights.items():
                    params[name].copy_(original)
                self._saved_weights.clear()
            if wanted is not None:
                self._corrupt_weights(model, wanted.corrupt_scale)
        with self._changed:
            self._weights_fault = wanted
            self._update()
        return True

    def _corrupt_weights(self, model: Transformer, scale: float) -> None:
        import torch

        prefix = f"layers.{corrupted_layer(model)}."
        generator = torch.Generator().manual_seed(_NOISE_SEED)
        for name, param in sorted(model.named_parameters()):
            if not name.startswith(prefix):
                continue
            self._saved_weights[name] = param.detach().clone()
            noise = torch.randn(param.shape, generator=generator)
            param.add_((noise * (scale * float(param.float().std()))).to(device=param.device, dtype=param.dtype))
