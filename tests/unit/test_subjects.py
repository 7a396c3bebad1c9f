"""Subject and key names are built in one place and refuse unsafe worker ids."""

import pytest

from phalanx.common import subjects

pytestmark = pytest.mark.unit


def test_per_worker_names_embed_the_worker_id():
    assert subjects.kv_events_subject("w-1_a") == "phalanx.kv.w-1_a"
    assert subjects.load_subject("w-1_a") == "phalanx.load.w-1_a"
    assert subjects.worker_key("w-1_a") == "/phalanx/v1/workers/w-1_a"


def test_wildcards_match_the_per_worker_subjects():
    assert subjects.KV_EVENTS_ALL == "phalanx.kv.*"
    assert subjects.LOAD_ALL == "phalanx.load.*"
    assert subjects.worker_key("x").startswith(subjects.WORKERS_PREFIX)


@pytest.mark.parametrize("bad", ["", "a.b", "a*", ">", "a b", "a/b", "w\n", "wörker", "a:b", None, 7])
def test_unsafe_worker_ids_are_rejected(bad):
    for build in (subjects.kv_events_subject, subjects.load_subject, subjects.worker_key):
        with pytest.raises(ValueError):
            build(bad)


def test_worker_id_is_recovered_from_subjects_and_keys():
    assert subjects.worker_id_from_subject(subjects.load_subject("w7")) == "w7"
    assert subjects.worker_id_from_subject(subjects.kv_events_subject("w7")) == "w7"
    assert subjects.worker_id_from_key(subjects.worker_key("w7").encode()) == "w7"
    with pytest.raises(ValueError):
        subjects.worker_id_from_subject("phalanx.other.w7")
    with pytest.raises(ValueError):
        subjects.worker_id_from_key("/phalanx/v1/workers/a/b")
