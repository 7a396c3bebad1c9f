"""Phalanx's engine side by side with transformers and llama.cpp on the same GGUF file, in one run.

Every engine gets the same token ids (the GGUF's own vocabulary, so one
tokenization serves all), greedy decoding with EOS ignored, and the same
CPU threads (EngineConfig.effective_torch_threads, what a worker gives its
engine). Two measures:

- decode at batch 1, 8, 16, 32: every sequence's prompt is prefilled and
  its first token out before the clock starts; then each step yields one
  token per sequence. Tokens/s is the aggregate over the decode steps, ITL
  p50/p99 the step times pooled over the repeats (a step's wall time is
  every sequence's inter-token latency);
- TTFT: one request alone, from submitting its prompt to its first token.

Phalanx runs twice: `float32`, the GGUF dequantized to float32 (the path
of old), and `auto`, whatever a worker serves with by default; both are
built by `model_for`, from an EngineConfig, as the worker builds its model.
transformers runs batch 1 only: its padded `generate` batch is not a
serving engine. llama.cpp (llama-cpp-python, optional) batches through its
low-level API: one context with a sequence per request in a unified KV.
Engines interleave within each repeat, so machine noise hits them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from phalanx.model.kv_cache import BLOCK_SIZE
from phalanx.model.sampling import SamplingParams
from phalanx.model.transformer import Transformer
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

BATCHES = (1, 8, 16, 32)
TTFT_PROMPT_LENS = (128, 1024, 4096)
# On this project's 2-core CPU: the `auto` variant against the float32 path of old and against llama.cpp.
GOALS = {
    "batch1_vs_float32": 2.0,
    "batch1_vs_llama_cpp": 0.5,
    "batch16_vs_float32": 2.0,
    "batch16_tokens_per_s": 200.0,
    "batch1_tokens_per_s": 34.0,
}
PhalanxVariant = Literal["float32", "auto"]
PHALANX_VARIANTS: tuple[PhalanxVariant, ...] = ("float32", "auto")


@dataclass(frozen=True)
class SideBySideSettings:
    """What `phalanx bench engine` measures side by side; the defaults keep the whole run near 5 minutes on 2 cores."""

    batches: tuple[int, ...] = BATCHES
    new_tokens: int = 32
    prompt_len: int = 32
    repeats: int = 2
    ttft_prompt_lens: tuple[int, ...] = TTFT_PROMPT_LENS
    ttft_repeats: int = 1


@dataclass(frozen=True)
class Decoded:
    """One decode run: the wall time of each step after the first token, and every sequence's tokens."""

    step_s: list[float]
    tokens: list[list[int]]


class SideEngine(Protocol):
    """What the side-by-side asks of an engine; max_batch 1 means it is measured at batch 1 only."""

    max_batch: int

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Decoded: ...

    def first_token_s(self, prompt: list[int]) -> float: ...


def model_for(config: EngineConfig) -> Transformer:
    """The model a worker with this engine config serves: the one place the variants' load arguments come from."""
    return config.load_model()


def variant_config(model: str, variant: PhalanxVariant, *, max_batch: int, seq_len: int, max_model_len: int) -> EngineConfig:
    """A worker's engine config for ``variant`` (a dtype; `auto` is the default's), sized for the bench's runs.

    Its KV holds ``max_batch`` decoding sequences of ``seq_len`` tokens, or one TTFT prompt of ``max_model_len``:
    the engine never preempts during a measurement, and the cache is no larger than the runs need.
    """
    blocks = max(max_batch * -(-seq_len // BLOCK_SIZE), -(-max_model_len // BLOCK_SIZE))
    return EngineConfig(
        model=model, dtype=variant, max_num_seqs=max_batch, max_model_len=max_model_len, num_kv_blocks=blocks + 16,
        prefix_caching=False,
    )


class PhalanxSide:
    """Phalanx's engine driven synchronously, as a worker's engine loop drives it, one engine reused across runs."""

    def __init__(self, model: Transformer, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.max_batch = config.max_num_seqs
        self.engine = Engine(model, config)
        self._runs = 0

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        self._runs += 1
        request_id = f"r{self._runs}"
        self.engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=request_id))
        return request_id

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Decoded:
        ids = [self._add(prompt, new_tokens) for prompt in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while any(not t for t in tokens.values()):
            for event in self.engine.step():
                tokens[event.request_id].append(event.token_id)
        steps = []
        while self.engine.has_work():
            start = time.perf_counter()
            events = self.engine.step()
            steps.append(time.perf_counter() - start)
            for event in events:
                tokens[event.request_id].append(event.token_id)
        return Decoded(steps, [tokens[i] for i in ids])

    def first_token_s(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self._add(prompt, 1)
        while not any(event.index == 0 for event in self.engine.step()):
            pass
        elapsed = time.perf_counter() - start
        while self.engine.has_work():
            self.engine.step()
        return elapsed


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def decode_figures(batch: int, runs: list[Decoded]) -> dict:
    """Tokens/s (median over the repeats) and ITL p50/p99 (steps pooled over the repeats) of one engine at one batch."""
    rates = [batch * len(run.step_s) / sum(run.step_s) for run in runs]
    steps = [s for run in runs for s in run.step_s]
    return {
        "batch": batch,
        "tokens_per_s": round(statistics.median(rates), 2),
        "itl_p50_ms": round(percentile(steps, 50) * 1000, 2),
        "itl_p99_ms": round(percentile(steps, 99) * 1000, 2),
    }


def measure(
    engines: dict[str, SideEngine], prompts_for: dict[int, list[list[int]]], *, batches: Iterable[int], new_tokens: int,
    repeats: int, ttft_prompts: dict[int, list[int]], ttft_repeats: int,
) -> dict[str, dict]:
    """Decode and TTFT figures per engine; engines interleave within each repeat."""
    figures: dict[str, dict] = {name: {"decode": [], "ttft_s": {}} for name in engines}
    largest = max([1, *batches])
    for engine in engines.values():  # warm-up: allocator, kernels, first-call setup, at both ends of the batches
        engine.decode(prompts_for[1], 4)
        if engine.max_batch >= largest > 1:
            engine.decode(prompts_for[largest], 4)
    for batch in batches:
        runs: dict[str, list[Decoded]] = {name: [] for name, engine in engines.items() if batch <= engine.max_batch}
        for _ in range(repeats):
            for name in runs:
                runs[name].append(engines[name].decode(prompts_for[batch], new_tokens))
        for name, decoded in runs.items():
            figures[name]["decode"].append(decode_figures(batch, decoded))
    for prompt_len, prompt in ttft_prompts.items():
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(ttft_repeats):
            for name, engine in engines.items():
                times[name].append(engine.first_token_s(prompt))
        for name, seconds in times.items():
            figures[name]["ttft_s"][str(prompt_len)] = round(statistics.median(seconds), 3)
    return figures


def tokens_per_s(figures: dict, engine: str, batch: int) -> float | None:
    return next((row["tokens_per_s"] for row in figures.get(engine, {}).get("decode", []) if row["batch"] == batch), None)


def goals_met(figures: dict[str, dict]) -> tuple[dict[str, float | None], dict[str, bool | None]]:
    """The figures the goals read and whether each is met; None where its reference (or batch) was not measured."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a / b, 3)

    auto1, auto16 = tokens_per_s(figures, "phalanx_auto", 1), tokens_per_s(figures, "phalanx_auto", 16)
    reached = {
        "batch1_vs_float32": ratio(auto1, tokens_per_s(figures, "phalanx_float32", 1)),
        "batch1_vs_llama_cpp": ratio(auto1, tokens_per_s(figures, "llama_cpp", 1)),
        "batch16_vs_float32": ratio(auto16, tokens_per_s(figures, "phalanx_float32", 16)),
        "batch16_tokens_per_s": auto16,
        "batch1_tokens_per_s": auto1,
    }
    return reached, {goal: None if value is None else value >= GOALS[goal] for goal, value in reached.items()}


def _references(gguf: Path | None, *, threads: int, max_batch: int, n_ctx: int) -> tuple[dict[str, SideEngine], dict[str, dict]]:
    """transformers and llama.cpp on the GGUF where each is installed; a reason for each that is not."""
    from phalanx.bench.engine_llama_cpp import LlamaCppSide, llama_cpp_version
    from phalanx.bench.engine_reference import TransformersSide, transformers_installed

    engines: dict[str, SideEngine] = {}
    skipped: dict[str, dict] = {}
    if gguf is None:
        return engines, {name: {"skipped": "not a GGUF model: nothing for it to load"} for name in ("transformers", "llama_cpp")}
    if transformers_installed():
        engines["transformers"] = TransformersSide(gguf)
    else:
        skipped["transformers"] = {"skipped": "transformers not installed (pip install transformers accelerate)"}
    if llama_cpp_version() is None:
        skipped["llama_cpp"] = {"skipped": "llama-cpp-python not installed (docs/development.md, Benchmarks)"}
    else:
        engines["llama_cpp"] = LlamaCppSide(gguf, threads=threads, max_batch=max_batch, n_ctx=n_ctx)
    return engines, skipped


def run_side_by_side(model: str, gguf: Path | None, settings: SideBySideSettings) -> dict:
    """The side-by-side report: figures per engine, the goals' figures, goals and met (a dict for `phalanx bench engine`)."""
    from phalanx.bench.engine_reference import prompts

    threads = EngineConfig().effective_torch_threads()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    batches, new_tokens, prompt_len = settings.batches, settings.new_tokens, settings.prompt_len
    max_batch = max([1, *batches])
    max_len = max(prompt_len + new_tokens, *settings.ttft_prompt_lens, 16) + 1
    engines: dict[str, SideEngine] = {}
    about: dict[str, dict] = {}
    try:
        for variant in PHALANX_VARIANTS:
            config = variant_config(model, variant, max_batch=max_batch, seq_len=prompt_len + new_tokens, max_model_len=max_len)
            built = model_for(config)
            engines[f"phalanx_{variant}"] = PhalanxSide(built, config)
            about[f"phalanx_{variant}"] = {"dtype": str(built.dtype).removeprefix("torch.")}
        references, skipped = _references(gguf, threads=threads, max_batch=max_batch, n_ctx=max(max_batch * (prompt_len + new_tokens), max_len))
        engines.update(references)
        prompts_for = {batch: prompts(built, batch, prompt_len) for batch in {1, *batches}}
        ttft_prompts = {n: prompts(built, 1, n)[0] for n in settings.ttft_prompt_lens}
        figures = measure(
            engines, prompts_for, batches=batches, new_tokens=new_tokens, repeats=settings.repeats, ttft_prompts=ttft_prompts,
            ttft_repeats=settings.ttft_repeats,
        )
    finally:
        torch.set_num_threads(previous_threads)
        for engine in engines.values():
            if hasattr(engine, "close"):
                engine.close()
    for name, engine in engines.items():
        figures[name] = {**about.get(name, {}), **getattr(engine, "about", {}), **figures[name]}
    figures.update(skipped)
    reached, met = goals_met(figures)
    return {
        "gguf": str(gguf) if gguf else None,
        "threads": threads,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
        "engines": figures,
        "reached": reached,
        "goals": dict(GOALS),
        "met": met,
    }
