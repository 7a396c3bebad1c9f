"""The MoE split on a CUDA device in bfloat16: experts held on the GPU give the monolithic model's greedy tokens.

The expert worker loads the model on the host in the engines' dtype and moves only its experts to its device; here
that path (`ExpertHost.from_model(..., device=...)`) feeds an attention-side model on the GPU in process. The
process-level path (expert and attention workers on the GPU, exchanges staged through host memory over gloo) is
the MoE integration suites run with PHALANX_ENGINE_DEVICE=cuda PHALANX_EXPERT_DEVICE=cuda (scripts/gpu_checks.sh).
Skipped without a GPU, CI included.
"""

import pytest
import torch

import phalanx.model
from phalanx.ert_manager.table import ErtManager, ExpertWorkerJoined, ExpertWorkerRef, place
from phalanx.model.expert_split import ExpertHost, LocalExperts, split_attention
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
MODEL = "phalanx-tiny-moe"


def greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = Engine(model, EngineConfig(device="cuda", deterministic=True))
    out = {engine.add_request(EngineRequest(p, SamplingParams(max_tokens=n, ignore_eos=True))).request_id: [] for p in prompts}
    while engine.has_work():
        for event in engine.step():
            out[event.request_id].append(event.token_id)
    return list(out.values())


def test_experts_moved_to_the_gpu_from_a_host_load_give_the_monoliths_greedy_tokens():
    monolithic = phalanx.model.load(MODEL, device="cuda", dtype=torch.bfloat16)
    on_host = phalanx.model.load(MODEL, dtype=torch.bfloat16)  # what an expert worker loads before keeping its experts
    c = on_host.config
    manager = ErtManager(MODEL, c.num_layers, c.num_experts)
    hosts = {}
    for i, hosted in enumerate(place(c.num_layers, c.num_experts, 2, 2)):
        hosts[f"ew-{i}"] = ExpertHost.from_model(on_host, [h.key for h in hosted], device="cuda")
        manager.apply(ExpertWorkerJoined(ExpertWorkerRef(f"ew-{i}", "", ""), tuple(hosted)))
    assert all(w.device.type == "cuda" and w.dtype is torch.bfloat16 for h in hosts.values() for pair in h.weights.values() for w in pair)
    split = split_attention(
        phalanx.model.load(MODEL, device="cuda", dtype=torch.bfloat16),
        LocalExperts(hosts, lambda layer, expert: manager.table.resolve(layer, expert)),
    )
    prompts = [monolithic.tokenizer.encode(f"stream {i}: the experts answer " * (1 + i % 3)) for i in range(8)]
    assert greedy(split, prompts, 24) == greedy(monolithic, prompts, 24)
