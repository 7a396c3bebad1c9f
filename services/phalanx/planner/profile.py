"""A worker's measured performance profile and its interpolators. Pure but for `save_profile` / `load_profile`.

What the replica maths needs to know about one worker (of `gpus_per_worker` GPUs), measured once before
deployment by `phalanx profile` (which calls `build_profile` on its samples):

- prefill, over input length (ISL): time to first token of a request prefilling alone, and the prefill
  throughput in tokens/s per worker (`isl / ttft` unless the sweep measured it under load);
- decode, over (context length, concurrency): inter-token latency and the decode throughput in tokens/s
  per worker (`concurrency / itl` unless measured).

Interpolation (numpy, no scipy: a simulated worker reads its step times from here, and importing scipy's
interpolators was a third of its start): prefill with PCHIP (shape-preserving cubic: no overshoot between
points, exact on them; scipy's PchipInterpolator, which a test compares it with), decode ITL bilinear on the
(context, concurrency) grid. Decode throughput is concurrency / ITL
times an efficiency (measured throughput over concurrency / ITL, 1.0 for derived throughputs) that is
interpolated bilinearly: throughput is concave in concurrency, and interpolating it directly between
powers of two underestimates it by ~10 %, while the efficiency varies slowly and matches every grid point. Off the grid every input is clamped to the
measured range: extrapolating a latency curve beyond its last point guesses, clamping says "at least as
fast as the largest point measured", and `covers()` tells the caller when that happens. Latencies must not
fall as load grows, but measurements are noisy (a lucky run at 64 sequences faster than at 32 would make
the "best throughput under an ITL target" jump past a real violation), so TTFT is interpolated on its
running maximum over ISL and ITL on its running maximum over concurrency and over context; throughputs are
interpolated as measured.

File schema (.npz, `np.savez`, read with allow_pickle=False), PROFILE_VERSION 1:

    version               int64 scalar      PROFILE_VERSION
    model                 str scalar        the model profiled
    gpus_per_worker       int64 scalar      GPUs of the profiled worker
    prefill_isl           float64 [P]       strictly increasing input lengths, tokens
    prefill_ttft_s        float64 [P]       seconds
    prefill_tokens_per_s  float64 [P]       prefill tokens/s per worker
    decode_context        float64 [C]       strictly increasing context lengths, tokens
    decode_concurrency    float64 [K]       strictly increasing running sequences
    decode_itl_s          float64 [C, K]    seconds
    decode_tokens_per_s   float64 [C, K]    decode tokens/s per worker
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.planner.errors import ProfileError

PROFILE_VERSION = 1
_ARRAYS_1D = ("prefill_isl", "prefill_ttft_s", "prefill_tokens_per_s", "decode_context", "decode_concurrency")
_ARRAYS_2D = ("decode_itl_s", "decode_tokens_per_s")
PROFILE_KEYS = ("version", "model", "gpus_per_worker", *_ARRAYS_1D, *_ARRAYS_2D)
# Points on which best_decode_throughput searches concurrency, besides the measured ones.
_SEARCH_POINTS = 512


@dataclass(frozen=True)
class PrefillSample:
    """One prefill measurement: a request of `isl` tokens got its first token after `ttft_s`."""

    isl: float
    ttft_s: float
    # Tokens/s per worker when measured under load; None: isl / ttft_s (the request alone).
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class DecodeSample:
    """One decode measurement: `concurrency` sequences of `context` tokens each stepped every `itl_s`."""

    context: float
    concurrency: float
    itl_s: float
    # Tokens/s per worker when measured; None: concurrency / itl_s.
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class DecodeOperatingPoint:
    """Where a worker should run its decode batch: the concurrency with the best throughput whose ITL meets
    the target (`meets_target`), or, when none does, the lowest concurrency measured."""

    concurrency: float
    itl_s: float
    tokens_per_s_per_gpu: float
    meets_target: bool


def _clamp(value: float, grid: np.ndarray) -> float:
    return float(min(max(value, grid[0]), grid[-1]))


def pchip(x: np.ndarray, y: np.ndarray) -> Callable[[float], float]:
    """The monotone piecewise-cubic Hermite interpolant of (x, y) (Fritsch-Butland derivatives, as scipy's
    PchipInterpolator: weighted harmonic means inside, the three-point shape-preserving formula at the ends), for x
    within [x[0], x[-1]]; x strictly increasing, at least two points."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    h = np.diff(x)
    m = np.diff(y) / h
    d = np.zeros_like(y)
    if x.size == 2:
        d[:] = m[0]
    else:
        w1, w2 = 2 * h[1:] + h[:-1], h[1:] + 2 * h[:-1]
        same_sign = m[:-1] * m[1:] > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            inner = (w1 + w2) / (w1 / m[:-1] + w2 / m[1:])
        d[1:-1] = np.where(same_sign, inner, 0.0)
        d[0] = _pchip_end(h[0], h[1], m[0], m[1])
        d[-1] = _pchip_end(h[-1], h[-2], m[-1], m[-2])

    def at(value: float) -> float:
        k = int(np.clip(np.searchsorted(x, value, side="right") - 1, 0, x.size - 2))
        t = (value - x[k]) / h[k]
        t2, t3 = t * t, t * t * t
        return float((2 * t3 - 3 * t2 + 1) * y[k] + (t3 - 2 * t2 + t) * h[k] * d[k] + (-2 * t3 + 3 * t2) * y[k + 1]
                     + (t3 - t2) * h[k] * d[k + 1])

    return at


def _pchip_end(h0: float, h1: float, m0: float, m1: float) -> float:
    d = ((2 * h0 + h1) * m0 - h0 * m1) / (h0 + h1)
    if np.sign(d) != np.sign(m0):
        return 0.0
    if np.sign(m0) != np.sign(m1) and abs(d) > abs(3 * m0):
        return 3 * m0
    return float(d)


@dataclass(frozen=True, eq=False)
class PerformanceProfile:
    """A worker's measured prefill and decode performance (module docstring for units and shapes)."""

    model: str
    gpus_per_worker: int
    prefill_isl: np.ndarray
    prefill_ttft_s: np.ndarray
    prefill_tokens_per_s: np.ndarray
    decode_context: np.ndarray
    decode_concurrency: np.ndarray
    decode_itl_s: np.ndarray
    decode_tokens_per_s: np.ndarray
    version: int = field(default=PROFILE_VERSION)

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ProfileError(f"profile version {self.version} is not the supported {PROFILE_VERSION}")
        if self.gpus_per_worker < 1:
            raise ProfileError(f"gpus_per_worker must be >= 1, got {self.gpus_per_worker}")
        for name in (*_ARRAYS_1D, *_ARRAYS_2D):
            array = np.asarray(getattr(self, name), dtype=np.float64)
            object.__setattr__(self, name, array)
            if array.size == 0 or not np.all(np.isfinite(array)) or np.any(array <= 0):
                raise ProfileError(f"{name} must be non-empty, finite and positive")
        for name in ("prefill_isl", "decode_context", "decode_concurrency"):
            grid = getattr(self, name)
            if grid.ndim != 1 or np.any(np.diff(grid) <= 0):
                raise ProfileError(f"{name} must be one-dimensional and strictly increasing")
        points = self.prefill_isl.shape
        if self.prefill_ttft_s.shape != points or self.prefill_tokens_per_s.shape != points:
            raise ProfileError(f"prefill_ttft_s and prefill_tokens_per_s must have prefill_isl's shape {points}")
        grid_shape = (self.decode_context.size, self.decode_concurrency.size)
        if self.decode_itl_s.shape != grid_shape or self.decode_tokens_per_s.shape != grid_shape:
            raise ProfileError(f"decode_itl_s and decode_tokens_per_s must be [decode_context, decode_concurrency] = {grid_shape}")

    # Interpolators, built on first use.

    @cached_property
    def _prefill_ttft(self) -> Callable[[float], float]:
        return self._pchip(np.maximum.accumulate(self.prefill_ttft_s))

    @cached_property
    def _prefill_tokens_per_s(self) -> Callable[[float], float]:
        return self._pchip(self.prefill_tokens_per_s)

    def _pchip(self, values: np.ndarray) -> Callable[[float], float]:
        if values.size == 1:
            constant = float(values[0])
            return lambda _isl: constant
        curve = pchip(self.prefill_isl, values)
        return lambda isl: curve(_clamp(isl, self.prefill_isl))

    @cached_property
    def _monotone_itl(self) -> np.ndarray:
        return np.maximum.accumulate(np.maximum.accumulate(self.decode_itl_s, axis=1), axis=0)

    def _grid_interpolator(self, values: np.ndarray) -> Callable[[float, np.ndarray], np.ndarray]:
        """Bilinear over the decode grid, vectorised over concurrency; inputs clamped to the grid."""
        contexts, concurrencies = self.decode_context, self.decode_concurrency

        def at(context: float, concurrency: np.ndarray) -> np.ndarray:
            # Linear in context between the two rows around it, then linear in concurrency along that row.
            c = _clamp(context, contexts)
            i = int(np.clip(np.searchsorted(contexts, c, side="right") - 1, 0, max(contexts.size - 2, 0)))
            if contexts.size == 1:
                row = values[0]
            else:
                t = (c - contexts[i]) / (contexts[i + 1] - contexts[i])
                row = (1.0 - t) * values[i] + t * values[i + 1]
            return np.interp(np.asarray(concurrency, dtype=np.float64), concurrencies, row)

        return at

    @cached_property
    def _decode_itl(self) -> Callable[[float, np.ndarray], np.ndarray]:
        return self._grid_interpolator(self._monotone_itl)

    @cached_property
    def _decode_efficiency(self) -> Callable[[float, np.ndarray], np.ndarray]:
        # Measured throughput over concurrency / ITL (1.0 when the throughput was derived from the ITL).
        return self._grid_interpolator(self.decode_tokens_per_s * self._monotone_itl / self.decode_concurrency[np.newaxis, :])

    def _decode_tokens_per_s(self, context: float, concurrency: np.ndarray) -> np.ndarray:
        clamped = np.clip(concurrency, self.decode_concurrency[0], self.decode_concurrency[-1])
        return self._decode_efficiency(context, concurrency) * clamped / self._decode_itl(context, concurrency)

    # Queries.

    def prefill_ttft(self, isl: float) -> float:
        """Seconds to the first token of a request of `isl` tokens prefilling alone."""
        return self._prefill_ttft(isl)

    def prefill_throughput_per_gpu(self, isl: float) -> float:
        """Prefill tokens/s one GPU of a worker sustains on prompts of `isl` tokens."""
        return self._prefill_tokens_per_s(isl) / self.gpus_per_worker

    def decode_itl(self, context: float, concurrency: float) -> float:
        """Seconds between tokens with `concurrency` sequences of `context` tokens in the batch."""
        return float(self._decode_itl(context, np.array([concurrency], dtype=np.float64))[0])

    def decode_throughput_per_gpu(self, context: float, concurrency: float) -> float:
        """Decode tokens/s per GPU at that batch."""
        return float(self._decode_tokens_per_s(context, np.array([concurrency], dtype=np.float64))[0]) / self.gpus_per_worker

    def best_decode(self, itl_target_s: float, context: float) -> DecodeOperatingPoint:
        """The highest decode throughput per GPU at `context` whose ITL stays within `itl_target_s`, searched
        over the measured concurrencies and a fine grid between them; when no concurrency meets the target,
        the lowest one (the fastest the worker steps), marked as missing it."""
        grid = self.decode_concurrency
        candidates = np.unique(np.concatenate([grid, np.linspace(grid[0], grid[-1], _SEARCH_POINTS)]))
        itl = self._decode_itl(context, candidates)
        throughput = self._decode_tokens_per_s(context, candidates) / self.gpus_per_worker
        meets = itl <= itl_target_s
        if not meets.any():
            return DecodeOperatingPoint(float(candidates[0]), float(itl[0]), float(throughput[0]), False)
        best = int(np.argmax(np.where(meets, throughput, -np.inf)))
        return DecodeOperatingPoint(float(candidates[best]), float(itl[best]), float(throughput[best]), True)

    def best_decode_throughput_per_gpu(self, itl_target_s: float, context: float) -> float:
        """Dynamo's `find_best_throughput_per_gpu`: tokens/s per GPU of `best_decode`."""
        return self.best_decode(itl_target_s, context).tokens_per_s_per_gpu

    def covers(self, *, isl: float | None = None, context: float | None = None, concurrency: float | None = None) -> bool:
        """Whether the inputs lie inside the measured ranges (outside, answers are clamped to the edge)."""
        checks = ((isl, self.prefill_isl), (context, self.decode_context), (concurrency, self.decode_concurrency))
        return all(value is None or grid[0] <= value <= grid[-1] for value, grid in checks)


def build_profile(
    prefill: Iterable[PrefillSample], decode: Iterable[DecodeSample], *, model: str, gpus_per_worker: int = 1
) -> PerformanceProfile:
    """A profile from measured samples (what `phalanx profile` collects). Repeated measurements of one point
    are reduced to their median (robust to one slow run); decode grid cells the sweep did not measure are
    filled from the nearest measured cell in grid-index space, so a sweep that skipped the largest
    concurrency at the longest context (out of KV, say) still gives a full grid."""
    prefill_points: dict[float, list[tuple[float, float]]] = defaultdict(list)
    for s in prefill:
        if not (math.isfinite(s.isl) and math.isfinite(s.ttft_s) and s.isl > 0 and s.ttft_s > 0):
            raise ProfileError(f"prefill sample needs positive finite isl and ttft_s, got {s}")
        prefill_points[s.isl].append((s.ttft_s, s.tokens_per_s if s.tokens_per_s is not None else s.isl / s.ttft_s))
    decode_points: dict[tuple[float, float], list[tuple[float, float]]] = defaultdict(list)
    for d in decode:
        if not all(math.isfinite(v) and v > 0 for v in (d.context, d.concurrency, d.itl_s)):
            raise ProfileError(f"decode sample needs positive finite context, concurrency and itl_s, got {d}")
        decode_points[(d.context, d.concurrency)].append((d.itl_s, d.tokens_per_s if d.tokens_per_s is not None else d.concurrency / d.itl_s))
    if not prefill_points or not decode_points:
        raise ProfileError("a profile needs at least one prefill and one decode sample")

    isls = sorted(prefill_points)
    contexts = sorted({c for c, _ in decode_points})
    concurrencies = sorted({k for _, k in decode_points})
    itl = np.full((len(contexts), len(concurrencies)), np.nan)
    tokens = np.full_like(itl, np.nan)
    for (context, concurrency), values in decode_points.items():
        i, j = contexts.index(context), concurrencies.index(concurrency)
        itl[i, j] = statistics.median(v[0] for v in values)
        tokens[i, j] = statistics.median(v[1] for v in values)
    if np.isnan(itl).any():
        itl, tokens = _fill_nearest(itl), _fill_nearest(tokens)
    return PerformanceProfile(
        model=model,
        gpus_per_worker=gpus_per_worker,
        prefill_isl=np.array(isls),
        prefill_ttft_s=np.array([statistics.median(v[0] for v in prefill_points[x]) for x in isls]),
        prefill_tokens_per_s=np.array([statistics.median(v[1] for v in prefill_points[x]) for x in isls]),
        decode_context=np.array(contexts),
        decode_concurrency=np.array(concurrencies),
        decode_itl_s=itl,
        decode_tokens_per_s=tokens,
    )


def _fill_nearest(grid: np.ndarray) -> np.ndarray:
    from scipy.interpolate import NearestNDInterpolator

    measured = np.argwhere(~np.isnan(grid))
    nearest = NearestNDInterpolator(measured, grid[~np.isnan(grid)])
    filled = grid.copy()
    missing = np.argwhere(np.isnan(grid))
    filled[tuple(missing.T)] = nearest(missing)
    return filled


def save_profile(profile: PerformanceProfile, path: str | Path) -> None:
    """Write the profile as .npz (schema in the module docstring)."""
    arrays: dict[str, Any] = {name: getattr(profile, name) for name in (*_ARRAYS_1D, *_ARRAYS_2D)}
    with open(path, "wb") as out:
        np.savez(
            out, version=np.int64(profile.version), model=np.str_(profile.model), gpus_per_worker=np.int64(profile.gpus_per_worker), **arrays
        )


def load_profile(path: str | Path) -> PerformanceProfile:
    """Read a profile written by `save_profile`; a file of another version or shape raises ProfileError."""
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [key for key in PROFILE_KEYS if key not in data.files]
            if missing:
                raise ProfileError(f"{path}: not a Phalanx profile, missing {', '.join(missing)}")
            contents = {key: data[key] for key in PROFILE_KEYS}
    except (OSError, ValueError) as exc:  # a missing file, or not an .npz at all
        raise ProfileError(f"{path}: cannot read a profile ({exc})") from None
    try:
        return PerformanceProfile(
            version=int(contents["version"]),
            model=str(contents["model"]),
            gpus_per_worker=int(contents["gpus_per_worker"]),
            **{name: contents[name] for name in (*_ARRAYS_1D, *_ARRAYS_2D)},
        )
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
