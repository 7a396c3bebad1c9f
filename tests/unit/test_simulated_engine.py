"""The simulated engine: the real Engine (scheduling, KV blocks, prefix cache, snapshots) with the simulated runner.

Its tokens are a function of (prompt, position, seed), the same on every engine and after a resume; its steps take
what the profile says (a slow synthetic profile here, so that the measured step times are the sleep's, not noise)."""

from __future__ import annotations

import statistics

import pytest

from phalanx.common.errors import InvalidRequestError
from phalanx.model.config import served_model
from phalanx.model.sampling import SamplingParams
from phalanx.planner.profile import DecodeSample, PrefillSample, build_profile, save_profile
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
from phalanx.worker.sequence import FinishReason
from phalanx.worker.simulated import default_profile_path, load_simulated, simulated_token

pytestmark = pytest.mark.unit

# ITL 4 ms for one sequence, 40 ms for 32: a tenfold difference that a loaded box cannot blur.
ITL_S = {1: 0.004, 8: 0.010, 32: 0.040}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "slow.npz"
    prefill = [PrefillSample(isl=float(n), ttft_s=0.002 + n * 1e-5) for n in (16, 256, 2048)]
    decode = [DecodeSample(context=float(c), concurrency=float(k), itl_s=itl) for c in (64, 1024) for k, itl in ITL_S.items()]
    save_profile(build_profile(prefill, decode, model="phalanx-tiny-moe"), path)
    return path


def sim_engine(profile_path, **config) -> Engine:
    engine_config = EngineConfig(engine="sim", profile=str(profile_path), **config)
    model, runner = load_simulated(engine_config)
    return Engine(model, engine_config, runner=runner)


def run(engine: Engine, requests: list[EngineRequest]) -> dict[str, list]:
    out: dict[str, list] = {engine.add_request(r).request_id: [] for r in requests}
    while engine.has_work():
        for event in engine.step():
            out[event.request_id].append(event)
    return out


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_the_simulated_model_says_what_it_is(profile_path) -> None:
    engine = sim_engine(profile_path)
    assert engine.model.config.name == "sim:phalanx-tiny-moe"
    assert served_model(engine.model.config.name) == "phalanx-tiny-moe"
    assert engine.model.version.startswith("sim:phalanx-tiny-moe:slow:")
    assert engine.cache.full_shape == (1, 2, engine.config.num_kv_blocks, 16, 1, 1)  # a few kilobytes of cache


def test_tokens_are_a_function_of_prompt_position_and_seed_on_every_engine(profile_path) -> None:
    prompts = [[10 + i, 20, 30 + i, 40] * (i + 1) for i in range(6)]
    first = run(sim_engine(profile_path), [EngineRequest(p, greedy(10), request_id=f"r{i}") for i, p in enumerate(prompts)])
    # Another engine, the requests one at a time: batching does not change a token.
    second = {}
    for i, p in enumerate(prompts):
        second.update(run(sim_engine(profile_path), [EngineRequest(p, greedy(10), request_id=f"r{i}")]))
    tokens = {r: [e.token_id for e in events] for r, events in first.items()}
    assert tokens == {r: [e.token_id for e in events] for r, events in second.items()}
    alphabet = sim_engine(profile_path).runner.alphabet  # type: ignore[attr-defined]
    assert tokens["r0"] == [simulated_token(prompts[0], i, 0, alphabet) for i in range(10)]
    assert len({tuple(t) for t in tokens.values()}) == len(prompts)  # different prompts, different outputs
    assert all(events[-1].finish_reason is FinishReason.LENGTH for events in first.values())
    # Readable text, never EOS: a request runs to max_tokens.
    text = "".join(e.text for e in first["r0"])
    assert len(text) == 10 and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
    # A sampled request's tokens follow its seed.
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
    again = SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=8, temperature=0.8, seed=8, ignore_eos=True)
    runs = [run(sim_engine(profile_path), [EngineRequest(prompts[0], p, request_id="s")])["s"] for p in (sampled, again, other)]
    assert [e.token_id for e in runs[0]] == [e.token_id for e in runs[1]] != [e.token_id for e in runs[2]]


def test_a_request_handed_back_midway_continues_the_same_tokens_elsewhere(profile_path) -> None:
    prompt = list(range(50, 90))
    (whole,) = run(sim_engine(profile_path), [EngineRequest(prompt, greedy(12), request_id="a")]).values()
    source = sim_engine(profile_path)
    source.add_request(EngineRequest(prompt, greedy(12), request_id="a"))
    produced = []
    while len(produced) < 5:
        produced += source.step()
    (handback,) = source.park(["a"], ttl_s=5.0)
    assert handback.handoff is not None and handback.handoff_kv_tokens > 0
    kv = source.export_kv("a", handback.handoff_kv_tokens)
    target = sim_engine(profile_path)
    target.restore(EngineRequest([], greedy(12), request_id="a", resume=handback.handoff, migrated=True), kv, handback.handoff_kv_tokens)
    rest = []
    while target.has_work():
        rest += target.step()
    assert [e.token_id for e in produced] + [e.token_id for e in rest] == [e.token_id for e in whole]


def test_kv_blocks_and_prefix_cache_are_the_real_engines(profile_path) -> None:
    engine = sim_engine(profile_path, num_kv_blocks=64, max_model_len=1024)
    prompt = list(range(1, 65))  # four full blocks
    run(engine, [EngineRequest(prompt, greedy(2), request_id="x")])
    stored = engine.drain_kv_events().stored
    assert len(stored) >= 4  # the router indexes these blocks as a real worker's
    first = engine.add_request(EngineRequest(prompt + [7, 8], greedy(2), request_id="y"))
    engine.step()
    assert first.cached_prompt_tokens == 64  # the prefix cache hit
    assert engine.prefix_hit_tokens == 64


def test_step_times_follow_the_profile(profile_path) -> None:
    def decode_step_seconds(concurrency: int) -> float:
        engine = sim_engine(profile_path)
        for i in range(concurrency):
            engine.add_request(EngineRequest([i + 1] * 48, greedy(8), request_id=f"{concurrency}-{i}"))
        engine.step()  # the prefills
        times = []
        while engine.has_work():
            engine.step()
            if engine.last_step.decode_tokens == concurrency:
                times.append(engine.last_step.seconds)
        return statistics.median(times)

    one, eight, many = decode_step_seconds(1), decode_step_seconds(8), decode_step_seconds(32)
    # Never faster than the profile (the sleep), and more concurrency is longer steps, as the profile says.
    assert one >= ITL_S[1] and eight >= ITL_S[8] and many >= ITL_S[32]
    assert one < eight < many
    assert many > 4 * one  # the profile's tenfold, with room for a busy box's noise on the short step


def test_the_shipped_profile_loads_as_package_data() -> None:
    path = default_profile_path()
    assert path.is_file()
    engine_config = EngineConfig(engine="sim")
    model, runner = load_simulated(engine_config)
    assert model.config.name == "sim:phalanx-tiny-moe"
    assert runner.step_seconds(0, [64] * 32) > runner.step_seconds(0, [64])


def test_a_simulated_worker_refuses_logprobs_it_has_no_logits_for() -> None:
    engine_config = EngineConfig(engine="sim")
    model, runner = load_simulated(engine_config)
    engine = Engine(model, engine_config, runner=runner)
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=2, logprobs=True)))
    assert caught.value.violations[0].field == "sampling.logprobs"
    assert engine.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=2))).request_id  # without, as before


def test_the_simulated_engine_refuses_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match="simulated engine runs in one process"):
        EngineConfig(engine="sim", tensor_parallel_size=2)


def test_a_missing_profile_is_refused_at_configuration() -> None:
    with pytest.raises(ValueError, match="is not a file"):
        EngineConfig(engine="sim", profile="/nonexistent/profile.npz")


SIM_PATH_WITHOUT_TORCH = """
import sys
from phalanx.model.sampling import SamplingParams
from phalanx.worker.checkpointing import CheckpointCapture, batch_of
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
import phalanx.worker.process  # noqa: F401 - the worker process module, as `phalanx worker` imports it
from phalanx.worker.server import snapshot_to_proto
from phalanx.worker.simulated import load_simulated

config = EngineConfig(engine="sim", profile=sys.argv[1])
model, runner = load_simulated(config)
engine = Engine(model, config, runner=runner)
capture = CheckpointCapture(interval_tokens=4)
capture.connected = True  # as once its streamer reached a store
for i, params in enumerate([SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, temperature=0.8, seed=3)]):
    engine.add_request(EngineRequest(list(range(20 + i, 60 + i)), params, request_id=str(i)))
steps = 0
while engine.has_work() and steps < 6:
    engine.step()
    capture.capture(engine)
    steps += 1
kv_bytes = sum(len(segment.kv) for segment in batch_of(capture.take(), snapshot_to_proto).segments)
print(kv_bytes, "torch" in sys.modules, "scipy" in sys.modules)
"""


def test_the_simulated_path_runs_and_checkpoints_without_importing_torch_or_scipy(profile_path, tmp_path) -> None:
    # A new process: this one imported torch long ago (other tests). Sampled and greedy requests, KV checkpoints.
    import subprocess
    import sys

    script = tmp_path / "sim_path.py"
    script.write_text(SIM_PATH_WITHOUT_TORCH)
    done = subprocess.run([sys.executable, str(script), str(profile_path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    kv_bytes, torch_imported, scipy_imported = done.stdout.split()
    # Nor scipy: the profile interpolates with numpy (a third of a simulated worker's start was scipy's interpolators).
    assert int(kv_bytes) > 0 and torch_imported == "False" and scipy_imported == "False"
