"""Performance profiles: building from samples, .npz round trip, interpolation on and off the grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from phalanx.planner.errors import ProfileError
from phalanx.planner.profile import (
    PROFILE_VERSION,
    DecodeSample,
    PerformanceProfile,
    PrefillSample,
    build_profile,
    load_profile,
    save_profile,
)

pytestmark = pytest.mark.unit

ISLS = [128.0, 512.0, 2048.0, 8192.0]
CONTEXTS = [256.0, 1024.0, 4096.0]
CONCURRENCIES = [1.0, 4.0, 16.0, 64.0]


def ttft(isl: float) -> float:
    """10k tokens/s plus a quadratic attention term and 10 ms of overhead."""
    return 0.01 + isl / 10_000.0 + (isl / 40_000.0) ** 2


def itl(context: float, concurrency: float) -> float:
    """Bilinear in (context, concurrency), so the interpolation is exact on it: 10 ms plus per-sequence work that grows with context."""
    return 0.01 + concurrency * (2e-4 + context * 1e-7)


def synthetic_profile(gpus_per_worker: int = 1) -> PerformanceProfile:
    prefill = [PrefillSample(isl=x, ttft_s=ttft(x)) for x in ISLS]
    decode = [DecodeSample(context=c, concurrency=k, itl_s=itl(c, k)) for c in CONTEXTS for k in CONCURRENCIES]
    return build_profile(prefill, decode, model="synthetic", gpus_per_worker=gpus_per_worker)


def test_interpolation_is_exact_on_grid_points() -> None:
    profile = synthetic_profile()
    for x in ISLS:
        assert profile.prefill_ttft(x) == pytest.approx(ttft(x))
        assert profile.prefill_throughput_per_gpu(x) == pytest.approx(x / ttft(x))
    for c in CONTEXTS:
        for k in CONCURRENCIES:
            assert profile.decode_itl(c, k) == pytest.approx(itl(c, k))
            assert profile.decode_throughput_per_gpu(c, k) == pytest.approx(k / itl(c, k))


def test_off_grid_values_are_clamped_to_the_measured_range() -> None:
    profile = synthetic_profile()
    assert profile.prefill_ttft(10.0) == pytest.approx(ttft(ISLS[0]))
    assert profile.prefill_ttft(100_000.0) == pytest.approx(ttft(ISLS[-1]))
    assert profile.decode_itl(50_000.0, 1_000.0) == pytest.approx(itl(CONTEXTS[-1], CONCURRENCIES[-1]))
    assert profile.decode_itl(1.0, 0.5) == pytest.approx(itl(CONTEXTS[0], CONCURRENCIES[0]))
    assert profile.covers(isl=512.0, context=300.0, concurrency=2.0)
    assert not profile.covers(isl=100_000.0)
    assert not profile.covers(concurrency=0.5)


def test_between_grid_points_interpolation_stays_between_neighbours_and_close_to_the_truth() -> None:
    profile = synthetic_profile()
    previous = 0.0
    for x in np.linspace(ISLS[0], ISLS[-1], 200):
        value = profile.prefill_ttft(float(x))
        assert value >= previous  # PCHIP keeps monotone data monotone: no overshoot dip between points
        previous = value
        assert value == pytest.approx(ttft(float(x)), rel=0.1)
    # Bilinear data is reproduced exactly between points too.
    assert profile.decode_itl(640.0, 10.0) == pytest.approx(itl(640.0, 10.0))


def test_noisy_latencies_are_made_monotone_before_interpolation() -> None:
    # A lucky run: 16 sequences stepped faster than 4 at context 1024.
    decode = [DecodeSample(context=c, concurrency=k, itl_s=itl(c, k)) for c in CONTEXTS for k in CONCURRENCIES]
    decode = [d if (d.context, d.concurrency) != (1024.0, 16.0) else DecodeSample(1024.0, 16.0, itl_s=0.005) for d in decode]
    profile = build_profile([PrefillSample(512.0, 0.06), PrefillSample(1024.0, 0.05)], decode, model="noisy")
    itls = [profile.decode_itl(1024.0, k) for k in np.linspace(1, 64, 100)]
    assert all(b >= a for a, b in zip(itls, itls[1:], strict=False))
    assert profile.prefill_ttft(1024.0) == pytest.approx(0.06)  # TTFT over ISL too
    # The lucky cell does not let best_decode pick 16 sequences under a target that 4 sequences already miss.
    target = itl(1024.0, 4.0) - 1e-4
    assert profile.best_decode(target, 1024.0).concurrency < 4.0


@pytest.mark.parametrize("context", [256.0, 1000.0, 4096.0])
@pytest.mark.parametrize("target", [0.015, 0.03])
def test_best_decode_throughput_meets_the_itl_target_at_the_highest_concurrency(context: float, target: float) -> None:
    profile = synthetic_profile()
    point = profile.best_decode(target, context)
    # Throughput k / itl grows with k here, so the best point is the largest k with itl(k) <= target.
    largest = (target - 0.01) / (2e-4 + context * 1e-7)
    assert point.meets_target
    assert point.itl_s <= target
    assert point.concurrency == pytest.approx(min(largest, 64.0), rel=0.02)
    assert point.tokens_per_s_per_gpu == pytest.approx(point.concurrency / itl(context, point.concurrency), rel=0.05)
    assert profile.best_decode_throughput_per_gpu(target, context) == point.tokens_per_s_per_gpu


def test_best_decode_with_an_unreachable_target_reports_the_lowest_concurrency() -> None:
    point = synthetic_profile().best_decode(0.001, 1024.0)
    assert not point.meets_target
    assert point.concurrency == 1.0
    assert point.itl_s == pytest.approx(itl(1024.0, 1.0))


def test_throughput_per_gpu_divides_the_workers_by_its_gpus() -> None:
    one, two = synthetic_profile(1), synthetic_profile(2)
    assert two.prefill_throughput_per_gpu(512.0) == pytest.approx(one.prefill_throughput_per_gpu(512.0) / 2)
    assert two.best_decode_throughput_per_gpu(0.02, 1024.0) == pytest.approx(one.best_decode_throughput_per_gpu(0.02, 1024.0) / 2)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    profile = synthetic_profile(gpus_per_worker=2)
    path = tmp_path / "profile.npz"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert (loaded.model, loaded.gpus_per_worker, loaded.version) == ("synthetic", 2, PROFILE_VERSION)
    arrays = ("prefill_isl", "prefill_ttft_s", "prefill_tokens_per_s", "decode_context", "decode_concurrency", "decode_itl_s", "decode_tokens_per_s")
    for name in arrays:
        np.testing.assert_array_equal(getattr(loaded, name), getattr(profile, name))
    assert loaded.best_decode(0.02, 2000.0) == profile.best_decode(0.02, 2000.0)
    assert loaded.prefill_ttft(3000.0) == profile.prefill_ttft(3000.0)


def test_build_profile_takes_medians_and_fills_unmeasured_cells_from_the_nearest() -> None:
    prefill = [PrefillSample(512.0, 0.05), PrefillSample(512.0, 0.07), PrefillSample(512.0, 0.5), PrefillSample(1024.0, 0.1, tokens_per_s=20_000.0)]
    decode = [
        DecodeSample(256.0, 1.0, 0.010), DecodeSample(256.0, 1.0, 0.011), DecodeSample(256.0, 1.0, 0.090),
        DecodeSample(256.0, 8.0, 0.020, tokens_per_s=300.0), DecodeSample(4096.0, 1.0, 0.015),
        # (4096, 8) not measured: out of KV at the longest context with the most sequences.
    ]
    profile = build_profile(prefill, decode, model="m")
    assert profile.prefill_ttft(512.0) == pytest.approx(0.07)  # median of 0.05, 0.07, 0.5
    assert profile.prefill_throughput_per_gpu(512.0) == pytest.approx(512.0 / 0.07)
    assert profile.prefill_throughput_per_gpu(1024.0) == pytest.approx(20_000.0)  # measured under load, kept
    assert profile.decode_itl(256.0, 1.0) == pytest.approx(0.011)
    assert profile.decode_throughput_per_gpu(256.0, 8.0) == pytest.approx(300.0)  # measured under load, not 8 / 0.02
    assert profile.decode_throughput_per_gpu(256.0, 1.0) == pytest.approx(1.0 / 0.011)
    assert np.all(np.isfinite(profile.decode_itl_s))
    # The missing cell's nearest measured cells are (256, 8) and (4096, 1), equally near: either is a
    # measured value, never a NaN or a guess outside what was seen.
    assert profile.decode_itl_s[1, 1] in (0.020, 0.015)


def test_single_point_axes_answer_that_point_everywhere() -> None:
    profile = build_profile([PrefillSample(512.0, 0.05)], [DecodeSample(1024.0, 8.0, 0.02)], model="one")
    assert profile.prefill_ttft(10_000.0) == pytest.approx(0.05)
    assert profile.decode_itl(10.0, 100.0) == pytest.approx(0.02)
    assert profile.best_decode(0.05, 1024.0).tokens_per_s_per_gpu == pytest.approx(8.0 / 0.02)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 99}, "version 99"),
        ({"gpus_per_worker": 0}, "gpus_per_worker"),
        ({"prefill_isl": np.array([512.0, 128.0, 2048.0, 8192.0])}, "strictly increasing"),
        ({"prefill_ttft_s": np.array([0.1, 0.2])}, "prefill_isl's shape"),
        ({"decode_itl_s": np.ones((2, 2))}, r"\[decode_context, decode_concurrency\]"),
        ({"decode_tokens_per_s": -np.ones((3, 4))}, "finite and positive"),
        ({"prefill_ttft_s": np.array([0.1, np.nan, 0.2, 0.3])}, "finite and positive"),
    ],
)
def test_invalid_profiles_are_refused(changes: dict, message: str) -> None:
    base = synthetic_profile()
    fields = {name: getattr(base, name) for name in (
        "model", "gpus_per_worker", "prefill_isl", "prefill_ttft_s", "prefill_tokens_per_s",
        "decode_context", "decode_concurrency", "decode_itl_s", "decode_tokens_per_s", "version",
    )}
    with pytest.raises(ProfileError, match=message):
        PerformanceProfile(**{**fields, **changes})


def test_build_profile_refuses_empty_or_invalid_samples() -> None:
    with pytest.raises(ProfileError, match="at least one prefill and one decode"):
        build_profile([PrefillSample(512.0, 0.05)], [], model="m")
    with pytest.raises(ProfileError, match="prefill sample"):
        build_profile([PrefillSample(512.0, -1.0)], [DecodeSample(1.0, 1.0, 0.01)], model="m")
    with pytest.raises(ProfileError, match="decode sample"):
        build_profile([PrefillSample(512.0, 0.05)], [DecodeSample(1.0, float("nan"), 0.01)], model="m")


def test_loading_something_that_is_not_a_profile_says_so(tmp_path: Path) -> None:
    other = tmp_path / "other.npz"
    np.savez(other, weights=np.zeros(3))
    with pytest.raises(ProfileError, match="missing version"):
        load_profile(other)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(ProfileError, match="cannot read a profile"):
        load_profile(garbage)
    with pytest.raises(ProfileError, match="cannot read a profile"):
        load_profile(tmp_path / "absent.npz")
    old = tmp_path / "old.npz"
    save_profile(synthetic_profile(), old)
    contents = dict(np.load(old))
    contents["version"] = np.int64(0)
    np.savez(old, **contents)
    with pytest.raises(ProfileError, match="old.npz: profile version 0"):
        load_profile(old)


def test_the_numpy_interpolators_match_scipys() -> None:
    # The profile interpolates without scipy (a simulated worker's start); these are the curves scipy draws.
    from scipy.interpolate import PchipInterpolator, RegularGridInterpolator

    from phalanx.planner.profile import pchip

    rng = np.random.default_rng(13)
    for points in (2, 3, 5, 9):
        x = np.cumsum(rng.uniform(1, 100, points))
        for y in (np.cumsum(rng.uniform(0, 1, points)), rng.uniform(0.1, 2.0, points), np.full(points, 0.5)):
            queries = np.linspace(x[0], x[-1], 97)
            expected = PchipInterpolator(x, y)(queries)
            assert np.allclose([pchip(x, y)(q) for q in queries], expected, rtol=1e-9, atol=1e-12)
    contexts, concurrency = np.array([64.0, 256.0, 1024.0]), np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    itl = rng.uniform(0.01, 0.5, (3, 5))
    profile = PerformanceProfile(
        model="m", gpus_per_worker=1, prefill_isl=np.array([16.0, 512.0]), prefill_ttft_s=np.array([0.01, 0.1]),
        prefill_tokens_per_s=np.array([1600.0, 5120.0]), decode_context=contexts, decode_concurrency=concurrency,
        decode_itl_s=np.sort(itl, axis=1), decode_tokens_per_s=concurrency / np.sort(itl, axis=1),
    )
    grid = RegularGridInterpolator((contexts, concurrency), profile._monotone_itl, method="linear")
    for context in (10.0, 64.0, 100.0, 700.0, 1024.0, 5000.0):
        c = np.clip(context, 64.0, 1024.0)
        levels = np.array([0.5, 1.0, 3.0, 7.5, 16.0, 40.0])
        expected = grid(np.column_stack([np.full(6, c), np.clip(levels, 1.0, 16.0)]))
        assert np.allclose(profile._decode_itl(context, levels), expected, rtol=1e-12)
