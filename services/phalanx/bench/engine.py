"""`phalanx bench engine`: the engine's decode throughput against the model's bare forward loop.

The bare loop is the ceiling: the same model, batch and prompts, a
contiguous [batch, max_len] cache, argmax on a tensor, no scheduler, no
paging, no per-request bookkeeping. Variants run interleaved, repeats
reporting the median, so machine noise hits them alike.

A GGUF model (the default smollm2-135m-instruct among them) on the CPU is
run side by side with transformers and llama.cpp on the same file
(phalanx.bench.engine_side_by_side); without it (`side_by_side=False`),
against transformers' `generate` alone, with its load time to first token
(phalanx.bench.engine_reference).
"""

from __future__ import annotations

import statistics
import time

import torch

from phalanx.bench.engine_side_by_side import SideBySideSettings
from phalanx.model import load
from phalanx.model.attention import ContiguousCache
from phalanx.model.config import BUILTIN_MODELS, gguf_file
from phalanx.model.sampling import SamplingParams
from phalanx.model.transformer import Transformer
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

# Engine over its bare loop at batch 32, on every model.
GOALS = {"ratio_at_batch_32": 0.8}


def default_batches(model: str) -> list[int]:
    """1, 8, 32 on the tiny models; none on a real one, whose steps cost far more: its comparison with transformers runs anyway."""
    return [1, 8, 32] if model in BUILTIN_MODELS else []


def _prompts(model: Transformer, batch: int, prompt_len: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    # Distinct random prompts: no prefix-cache help for the engine.
    return torch.randint(0, 256, (batch, prompt_len), generator=gen).tolist()


@torch.inference_mode()
def bare_decode_tokens_per_s(model: Transformer, prompts: list[list[int]], decode_tokens: int) -> float:
    c = model.config
    batch, prompt_len = len(prompts), len(prompts[0])
    cache = ContiguousCache(c.num_layers, batch, prompt_len + decode_tokens + 1, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=model.device)
    ids = torch.tensor(prompts, device=model.device)
    positions = torch.arange(prompt_len, device=model.device).repeat(batch)
    cache.begin_step(prompt_len)
    hidden = model.hidden_states(ids.flatten(), positions, cache)
    cache.end_step()
    next_ids = model.logits(hidden.view(batch, prompt_len, -1)[:, -1]).argmax(-1)
    start = time.perf_counter()
    for _ in range(decode_tokens - 1):
        cache.begin_step(1)
        positions = torch.full((batch,), cache.length, device=model.device)
        next_ids = model.logits(model.hidden_states(next_ids, positions, cache)).argmax(-1)
        cache.end_step()
        next_ids.tolist()  # the engine hands tokens to Python each step; so does the baseline
    return batch * (decode_tokens - 1) / (time.perf_counter() - start)


def engine_decode_tokens_per_s(model: Transformer, prompts: list[list[int]], decode_tokens: int, *, deterministic: bool) -> float:
    batch, seq_len = len(prompts), len(prompts[0]) + decode_tokens
    config = EngineConfig(
        device=str(model.device), deterministic=deterministic, max_num_seqs=batch, max_batched_tokens=max(512, batch * len(prompts[0])),
        max_model_len=max(seq_len, 16), num_kv_blocks=batch * -(-seq_len // 16) + 16, prefix_caching=False,
    )
    engine = Engine(model, config)
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(prompt, params, request_id=str(i)))
    # Prefill every sequence (its first token) before the clock starts, as the bare loop does.
    started = 0
    while started < batch:
        started += sum(1 for e in engine.step() if e.index == 0)
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return batch * (decode_tokens - 1) / (time.perf_counter() - start)


def run_engine_bench(
    *, model: str, batches: list[int], decode_tokens: int, prompt_len: int, repeats: int, device: str = "cpu", dtype: str = "auto",
    side_by_side: bool | None = None, side: SideBySideSettings | None = None,
) -> dict:
    """The bare-loop matrix, then (a GGUF model on the CPU) the side by side, or with ``side_by_side=False`` the comparison
    with transformers alone. ``side_by_side`` None: on for a GGUF model on the CPU."""
    torch_dtype = EngineConfig.model_validate({"device": device, "dtype": dtype}).torch_dtype()
    m = load(model, device=device, dtype=torch_dtype)
    results = []
    for batch in batches:
        prompts = _prompts(m, batch, prompt_len)
        runs: dict[str, list[float]] = {"bare": [], "engine": [], "engine_deterministic": []}
        engine_decode_tokens_per_s(m, prompts, 4, deterministic=False)  # warm-up: allocator, kernels
        for _ in range(repeats):
            runs["bare"].append(bare_decode_tokens_per_s(m, prompts, decode_tokens))
            runs["engine"].append(engine_decode_tokens_per_s(m, prompts, decode_tokens, deterministic=False))
            runs["engine_deterministic"].append(engine_decode_tokens_per_s(m, prompts, decode_tokens, deterministic=True))
        med = {k: statistics.median(v) for k, v in runs.items()}
        results.append(
            {
                "batch": batch,
                "bare_tokens_per_s": round(med["bare"], 1),
                "engine_tokens_per_s": round(med["engine"], 1),
                "engine_deterministic_tokens_per_s": round(med["engine_deterministic"], 1),
                "ratio": round(med["engine"] / med["bare"], 3),
                "deterministic_cost": round(1 - med["engine_deterministic"] / med["engine"], 3),
            }
        )
    at_32 = next((r["ratio"] for r in results if r["batch"] == 32), None)
    report = {
        "model": model,
        "model_version": m.version,
        "decode_tokens": decode_tokens,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "device": torch.cuda.get_device_name(m.device) if m.device.type == "cuda" else "cpu",
        "dtype": str(torch_dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "results": results,
        "goals": dict(GOALS),
        # None: not measured in this run (batch 32 not asked for).
        "met": {"ratio_at_batch_32": None if at_32 is None else at_32 >= GOALS["ratio_at_batch_32"]},
    }
    gguf = None if model in BUILTIN_MODELS else gguf_file(model)
    # The references run on the CPU: compared only there.
    if side_by_side is None:
        side_by_side = gguf is not None and device == "cpu"
    if side_by_side and device != "cpu":
        raise ValueError("the side by side runs on the CPU, where its references run")
    if side_by_side:
        from phalanx.bench.engine_side_by_side import run_side_by_side

        del m  # the side by side loads its own variants
        report["side_by_side"] = run_side_by_side(model, gguf, side or SideBySideSettings())
        report["goals"].update(report["side_by_side"]["goals"])
        report["met"].update(report["side_by_side"]["met"])
    elif gguf is not None and device == "cpu":
        from phalanx.bench.engine_reference import compare_with_transformers

        versus = compare_with_transformers(m, model, gguf, new_tokens=decode_tokens, prompt_len=prompt_len, repeats=repeats)
        report["versus_transformers"] = versus["figures"]
        report["goals"].update(versus["goals"])
        report["met"].update(versus["met"])
    return report
