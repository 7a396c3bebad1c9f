"""Which backend two ends of a tensor channel agree on (common/channels/rendezvous.py)."""

import pytest

from phalanx.common.channels.rendezvous import agreed_backend

pytestmark = pytest.mark.unit


def test_two_ends_on_one_gpu_stage_through_host_memory_instead_of_nccl():
    # NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected", seen on an H200).
    assert agreed_backend("nccl", "GPU-aaaa", "GPU-aaaa") == "gloo"


def test_two_ends_on_different_gpus_keep_nccl():
    assert agreed_backend("nccl", "GPU-aaaa", "GPU-bbbb") == "nccl"


def test_gloo_stays_gloo_and_an_unnamed_gpu_changes_nothing():
    assert agreed_backend("gloo", None, None) == "gloo"
    assert agreed_backend("nccl", None, "GPU-aaaa") == "nccl"
