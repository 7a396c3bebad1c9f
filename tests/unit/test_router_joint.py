"""Joint (encoder, worker) choice of a media request by estimated time to first token, with and without overlap."""

import pytest

from phalanx.router.joint import EncoderEstimate, choose_joint, embedding_bytes, embedding_transfer_s, pair_ttft_s
from phalanx.router.routing import WorkerEstimate

pytestmark = pytest.mark.unit

MS = 1e-3


def test_overlap_hides_the_shorter_of_encoding_and_prefix_prefill():
    encoder = EncoderEstimate("e", 100 * MS)
    worker = WorkerEstimate("w", 10 * MS, 0.1 * MS, 0)  # 10 ms queue, 10,000 tokens/s
    # 800 prefix tokens: 90 ms with the queue, under the 100 ms encode; then 200 tokens of image and text: 20 ms.
    assert pair_ttft_s(encoder, worker, prefix_tokens=800, rest_tokens=200, overlap=True) == pytest.approx(0.120)
    assert pair_ttft_s(encoder, worker, prefix_tokens=800, rest_tokens=200, overlap=False) == pytest.approx(0.210)
    cached = WorkerEstimate("w", 10 * MS, 0.1 * MS, 800)
    assert pair_ttft_s(encoder, cached, prefix_tokens=800, rest_tokens=200, overlap=False) == pytest.approx(0.130)


def test_a_skewed_encoder_loses_to_an_idle_one():
    busy, idle = EncoderEstimate("busy", 400 * MS), EncoderEstimate("idle", 30 * MS)
    workers = [WorkerEstimate("w1", 5 * MS, 0.1 * MS, 0), WorkerEstimate("w2", 5 * MS, 0.1 * MS, 0)]
    choice = choose_joint([busy, idle], workers, prefix_tokens=50, rest_tokens=100, overlap=True)
    assert choice is not None and choice.encoder_id == "idle" and choice.worker_id == "w1"
    assert choice.ttft_s == pytest.approx(0.030 + 0.010)


def test_the_worker_depends_on_the_encoder_when_the_prefix_overlaps():
    # w-cached holds the long prefix but has a 150 ms queue; w-idle has none, is a bit faster, and must compute the
    # 2,000-token prefix (160 ms).
    cached = WorkerEstimate("w-cached", 150 * MS, 0.1 * MS, 2000)
    idle = WorkerEstimate("w-idle", 0.0, 0.08 * MS, 0)
    slow = EncoderEstimate("slow", 250 * MS)
    fast = EncoderEstimate("fast", 20 * MS)
    # While a 250 ms encode runs, the idle worker computes the prefix for free and is faster on the rest.
    with_slow = choose_joint([slow], [cached, idle], prefix_tokens=2000, rest_tokens=100, overlap=True)
    assert with_slow is not None and with_slow.worker_id == "w-idle" and with_slow.ttft_s == pytest.approx(0.258)
    # A 20 ms encode leaves the prefix on the critical path: the cached worker's 150 ms wait beats 160 ms of prefill.
    with_fast = choose_joint([fast], [cached, idle], prefix_tokens=2000, rest_tokens=100, overlap=True)
    assert with_fast is not None and with_fast.worker_id == "w-cached" and with_fast.prefix_cached_tokens == 2000
    # Sequentially the terms add up, and the encoder no longer changes the worker.
    for encoder in (slow, fast):
        choice = choose_joint([encoder], [cached, idle], prefix_tokens=2000, rest_tokens=100, overlap=False)
        assert choice is not None and choice.worker_id == "w-cached"


def test_a_transfer_term_per_pair_can_turn_the_choice():
    encoders = [EncoderEstimate("near", 50 * MS), EncoderEstimate("far", 40 * MS)]
    workers = [WorkerEstimate("w", 0.0, 0.1 * MS, 0)]
    assert choose_joint(encoders, workers, prefix_tokens=0, rest_tokens=10, overlap=True).encoder_id == "far"
    far_costs = {"far": 20 * MS, "near": 1 * MS}
    choice = choose_joint(encoders, workers, prefix_tokens=0, rest_tokens=10, overlap=True, transfer_s=lambda e, w: far_costs[e])
    assert choice is not None and choice.encoder_id == "near"


def test_no_pair_without_encoders_or_workers():
    assert choose_joint([], [WorkerEstimate("w", 0.0, 1e-4, 0)], prefix_tokens=1, rest_tokens=1, overlap=True) is None
    assert choose_joint([EncoderEstimate("e", 0.01)], [], prefix_tokens=1, rest_tokens=1, overlap=True) is None


def test_overlap_pays_only_when_its_saving_beats_the_prefixs_own_step():
    worker = WorkerEstimate("w", 0.0, 0.25 * MS, 0, step_s=20 * MS)  # 4,000 tokens/s, 20 ms steps
    encoder = EncoderEstimate("e", 30 * MS)
    short = choose_joint([encoder], [worker], prefix_tokens=32, rest_tokens=60, overlap=True)
    assert short is not None and short.overlap_gain_s == pytest.approx(0.008) and not short.overlap_pays(1.0)
    assert short.overlap_pays(0.0)  # 0: whenever there is anything to gain
    long = choose_joint([encoder], [worker], prefix_tokens=1024, rest_tokens=60, overlap=True)
    assert long is not None and long.overlap_gain_s == pytest.approx(0.030) and long.overlap_pays(1.0)
    cached = WorkerEstimate("w", 0.0, 0.25 * MS, 1024, step_s=20 * MS)
    held = choose_joint([encoder], [cached], prefix_tokens=1024, rest_tokens=60, overlap=True)
    assert held is not None and held.overlap_gain_s == 0 and not held.overlap_pays(0.0)


def test_embedding_bytes_and_transfer_time():
    assert embedding_bytes(576, 4096, "float32") == 576 * 4096 * 4
    assert embedding_bytes(576, 4096, "bfloat16") == embedding_bytes(576, 4096, "float16") == 576 * 4096 * 2
    assert embedding_bytes(10, 8, "") == 10 * 8 * 4  # an encoder that does not say: float32, its default
    nbytes = 9_437_184  # a LLaVA-sized image: 576 x 4096 float32
    assert embedding_transfer_s(nbytes, measured_bytes_per_s=0.0, link_bytes_per_s=1e9, through_router=False) == pytest.approx(0.009437184)
    assert embedding_transfer_s(nbytes, measured_bytes_per_s=4e9, link_bytes_per_s=1e9, through_router=False) == pytest.approx(0.002359296)
    assert embedding_transfer_s(nbytes, measured_bytes_per_s=4e9, link_bytes_per_s=1e9, through_router=True) == pytest.approx(0.018874368)
    assert embedding_transfer_s(0, measured_bytes_per_s=0.0, link_bytes_per_s=1e9, through_router=True) == 0.0


def test_a_slow_link_to_one_worker_steers_the_choice_to_another_worker():
    # w1 holds the prefix (no prefill) and w2 must compute it (20 ms): over equal links w1 wins.
    workers = [WorkerEstimate("w1", 0.0, 0.1 * MS, 200), WorkerEstimate("w2", 0.0, 0.1 * MS, 0)]
    even = EncoderEstimate("e", 10 * MS, transfer_s=2 * MS)
    choice = choose_joint([even], workers, prefix_tokens=200, rest_tokens=10, overlap=False)
    assert choice is not None and choice.worker_id == "w1" and choice.ttft_s == pytest.approx(0.012 + 0.001)
    # The encoder measured its link to w1 slow (50 ms for these rows): w2, priced by the encoder's overall figure, wins.
    slow_to_w1 = EncoderEstimate("e", 10 * MS, transfer_s=2 * MS, link_transfer_s={"w1": 50 * MS})
    assert (slow_to_w1.transfer_to("w1"), slow_to_w1.transfer_to("w2")) == (50 * MS, 2 * MS)
    choice = choose_joint([slow_to_w1], workers, prefix_tokens=200, rest_tokens=10, overlap=False)
    assert choice is not None and choice.worker_id == "w2" and choice.ttft_s == pytest.approx(0.012 + 0.020 + 0.001)
    # With two encoders the pair counts: the other encoder's fast link to w1 makes (other, w1) the best pair.
    other = EncoderEstimate("other", 15 * MS, transfer_s=30 * MS, link_transfer_s={"w1": 1 * MS})
    choice = choose_joint([slow_to_w1, other], workers, prefix_tokens=200, rest_tokens=10, overlap=False)
    assert choice is not None and (choice.encoder_id, choice.worker_id) == ("other", "w1")
    assert choice.ttft_s == pytest.approx(0.016 + 0.001)


def test_the_encoders_transfer_estimate_counts_in_the_pair_and_can_turn_the_choice():
    worker = WorkerEstimate("w", 0.0, 0.1 * MS, 0)
    # "fast" encodes 10 ms sooner but its link moves the rows 30 ms slower.
    fast = EncoderEstimate("fast", 20 * MS, transfer_s=35 * MS)
    slow = EncoderEstimate("slow", 30 * MS, transfer_s=5 * MS)
    assert pair_ttft_s(fast, worker, prefix_tokens=0, rest_tokens=10, overlap=True) == pytest.approx(0.055 + 0.001)
    choice = choose_joint([fast, slow], [worker], prefix_tokens=0, rest_tokens=10, overlap=True)
    assert choice is not None and choice.encoder_id == "slow" and choice.ttft_s == pytest.approx(0.035 + 0.001)
    # The per-pair hook adds to it.
    choice = choose_joint([fast, slow], [worker], prefix_tokens=0, rest_tokens=10, overlap=True, transfer_s=lambda e, w: 40 * MS * (e == "slow"))
    assert choice is not None and choice.encoder_id == "fast"
    # With overlap a transfer hides behind a longer prefix prefill, like the encode: 500 prefix tokens take 50 ms.
    assert pair_ttft_s(slow, worker, prefix_tokens=500, rest_tokens=10, overlap=True) == pytest.approx(0.050 + 0.001)
    long = choose_joint([slow], [worker], prefix_tokens=500, rest_tokens=10, overlap=True)
    assert long is not None and long.overlap_gain_s == pytest.approx(0.035)  # encode + transfer, the shorter side
