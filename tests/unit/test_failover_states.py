"""The failover engine's pure parts: probe answers per state, segment names, the slot's switch ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.worker.failover_engine import FailoverState, Probe, SwitchLedger, probe_status, segment_name

S = FailoverState


@pytest.mark.parametrize(
    ("state", "serving", "expected"),
    [
        (S.INIT, False, {Probe.STARTUP: 503, Probe.LIVE: 200, Probe.READY: 503}),
        (S.STANDBY, False, {Probe.STARTUP: 200, Probe.LIVE: 200, Probe.READY: 200}),
        (S.WAKING, False, {Probe.STARTUP: 200, Probe.LIVE: 200, Probe.READY: 200}),
        (S.ACTIVE, True, {Probe.STARTUP: 200, Probe.LIVE: 200, Probe.READY: 200}),
        (S.ACTIVE, False, {Probe.STARTUP: 200, Probe.LIVE: 200, Probe.READY: 503}),
        (S.DEAD, True, {Probe.STARTUP: 503, Probe.LIVE: 503, Probe.READY: 503}),
    ],
)
def test_probes_answer_by_state(state: FailoverState, serving: bool, expected: dict[Probe, int]) -> None:
    assert {probe: probe_status(state, probe, serving) for probe in Probe} == expected


def test_segment_names_are_file_names() -> None:
    assert segment_name("phalanx-tiny-moe@seed=0") == "phalanx-tiny-moe@seed=0"
    assert segment_name("org/model@0123456789ab") == "org_model@0123456789ab"


def test_switch_ledger_counts_survive_a_new_reader(tmp_path: Path) -> None:
    ledger = SwitchLedger(tmp_path / "failover.lock.switches.json")
    assert ledger.read() == {"attempts": 0, "successes": 0}
    ledger.add("attempts")
    ledger.add("attempts")
    ledger.add("successes")
    assert SwitchLedger(ledger.path).read() == {"attempts": 2, "successes": 1}
    ledger.path.write_text("not json")
    assert ledger.read() == {"attempts": 0, "successes": 0}
