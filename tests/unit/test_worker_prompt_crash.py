"""The poison-prompt fault: the engine step that first schedules a marked prompt kills the worker; nothing else does."""

from dataclasses import dataclass

import pytest

from phalanx.worker.fault_service import PromptCrash, arm_prompt_crash

pytestmark = pytest.mark.unit


@dataclass
class Seq:
    request_id: str
    prompt_ids: list[int]


def decode(ids: list[int]) -> str:
    return bytes(ids).decode()


def test_the_step_that_schedules_a_marked_prompt_kills_once_after_its_delay():
    kills: list[str] = []
    crash = PromptCrash("<<x>>", decode, delay_s=0.0, kill=lambda: kills.append("kill"))
    good = Seq("good", list(b"hello"))
    crash([(good, 5)])
    crash([(good, 1)])
    assert kills == []
    crash([(good, 1), (Seq("poison", list(b"a <<x>> b")), 9)])
    assert kills == ["kill"]


def test_a_prompt_is_decoded_once_while_it_stays_in_the_batch():
    decoded: list[list[int]] = []

    def counting(ids: list[int]) -> str:
        decoded.append(ids)
        return decode(ids)

    crash = PromptCrash("<<x>>", counting, delay_s=0.0, kill=lambda: None)
    seq = Seq("r", list(b"plain"))
    for _ in range(3):
        crash([(seq, 1)])
    assert len(decoded) == 1


def test_it_needs_a_marker_and_an_engine_in_the_workers_process():
    with pytest.raises(ValueError):
        PromptCrash("", decode)

    class Remote:  # an engine in a process of its own has no step hook here
        pass

    remote = Remote()
    arm_prompt_crash(remote, "<<x>>", decode)
    assert not hasattr(remote, "on_scheduled")
