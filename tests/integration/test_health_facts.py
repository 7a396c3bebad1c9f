"""The health service calibrates a real model's canary on a known fact: SmolLM2 must answer "The capital of France is" with " Paris"."""

import asyncio

import pytest

from phalanx.common.config import EtcdConfig
from phalanx.health.canary import canary_facts
from phalanx.launch.stack import Stack
from phalanx.model.config import BUILTIN_CHECKPOINTS, CheckpointError, model_tokenizer
from phalanx.testing.asserts import assert_eventually
from phalanx.testing.cleanup import forget_health_state

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"


@pytest.mark.slow
async def test_a_real_model_is_calibrated_on_its_known_fact(nats_server, etcd_server, tmp_path, monkeypatch):
    try:
        BUILTIN_CHECKPOINTS[MODEL].path()
    except CheckpointError as error:
        pytest.skip(str(error))
    # The worker dequantizes into a cache of its own; the test reads the tokenizer from the header it writes.
    monkeypatch.setenv("PHALANX_CACHE_DIR", str(tmp_path))
    etcd_config = EtcdConfig(endpoint=etcd_server.endpoint, lease_ttl_s=1)
    stack = Stack(nats_server.url, etcd_config, model=MODEL)
    try:
        small_kv = {"PHALANX_ENGINE_NUM_KV_BLOCKS": "64", "PHALANX_ENGINE_MAX_MODEL_LEN": "512"}
        await stack.add_workers(1, "--fast", env={"PHALANX_CACHE_DIR": str(tmp_path), **small_kv})
        health = await stack.add_health(env={"PHALANX_HEALTH_CHECK_INTERVAL_S": "1"})

        async def calibrated():
            listing = await health.list_health()
            # Calibrations of other models may be there too (the session's etcd is shared by test modules).
            mine = [c for c in listing.calibrations if c.model == MODEL]
            assert mine
            return mine[0]

        calibration = await assert_eventually(calibrated, timeout=30, interval=0.2)
        (fact,) = canary_facts(MODEL)
        (case,) = calibration.cases
        assert calibration.model == MODEL and case.prompt_text == fact.prompt
        assert model_tokenizer(MODEL).decode(list(case.expected_token_ids)) == fact.answer
        assert 0 < case.top_logit_min[0] <= case.top_logit_max[0]
    finally:
        await asyncio.to_thread(stack.stop)
        await forget_health_state(etcd_config)
