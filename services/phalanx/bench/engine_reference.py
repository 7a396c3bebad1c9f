"""Our engine on a real GGUF model against transformers' `generate` on the same file, and load time to first token.

TransformersSide is transformers' seat in the side-by-side (phalanx.bench.engine_side_by_side).

Both sides run in one process on the threads a worker gives its engine
(EngineConfig.effective_torch_threads: every core but one), float32, greedy, the same
prompt and the same number of new tokens (EOS ignored), prefill included:
tokens/s is new tokens over the wall time of the whole generation. Runs are
interleaved and the median is reported, so machine noise hits both alike.
Goals are ratios to transformers at batch 1: ours at batch 1, and ours in
aggregate over 16 concurrent streams.

Load time to first token is measured in a fresh interpreter, as a worker
starting up sees it: from the process's start (imports included) until the
engine has produced the first token, with the dequantized weights already
in the safetensors cache.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from phalanx.bench.engine_side_by_side import Decoded
from phalanx.model.sampling import SamplingParams
from phalanx.model.transformer import Transformer
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

GOALS = {"batch1_ratio": 1.0, "batch16_ratio": 4.0, "load_to_first_token_s": 5.0}
STREAMS = 16
_TEXT = (
    "The lighthouse keeper climbed the narrow stairs as the storm rolled in from the sea. Every night for thirty years "
    "he had lit the lamp, wound the clockwork and watched the ships pass safely around the rocks below the cliff, and "
    "every morning he wrote the weather, the wind and the names of the ships in a small leather book."
)
_FIRST_TOKEN = """
import json, sys, time
started = time.time()
from phalanx.model import load
from phalanx.bench.engine_side_by_side import Decoded
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest
imported = time.time()
model = load(sys.argv[1])
loaded = time.time()
engine = Engine(model, EngineConfig(model=sys.argv[1], num_kv_blocks=64, max_model_len=512))
engine.add_request(EngineRequest(model.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=1)))
while not any(event.index == 0 for event in engine.step()):
    pass
print(json.dumps({"started": started, "imported": imported, "loaded": loaded, "first_token": time.time()}))
"""


def prompts(model: Transformer, count: int, prompt_len: int) -> list[list[int]]:
    """``count`` distinct real-text prompts of exactly ``prompt_len`` tokens (distinct from the first token: no prefix sharing)."""
    out = []
    for i in range(count):
        ids = model.tokenizer.encode(f"Story {i + 1}. {_TEXT * (1 + prompt_len // 40)}", add_bos=True)
        if len(ids) < prompt_len:
            raise ValueError(f"prompt_len {prompt_len} is longer than the bench's text")
        out.append(ids[:prompt_len])
    return out


def engine_tokens_per_s(model: Transformer, batch: list[list[int]], new_tokens: int, *, deterministic: bool = False) -> float:
    """New tokens/s of our engine over the whole generation, prefill included (fast numerics unless ``deterministic``)."""
    seq_len = len(batch[0]) + new_tokens
    engine = Engine(
        model,
        EngineConfig(
            max_num_seqs=len(batch), max_batched_tokens=max(512, len(batch) * len(batch[0])), max_model_len=max(seq_len, 16),
            num_kv_blocks=len(batch) * -(-seq_len // 16) + 16, prefix_caching=False, deterministic=deterministic,
        ),
    )
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(batch):
        engine.add_request(EngineRequest(prompt, params, request_id=str(i)))
    while engine.has_work():
        engine.step()
    return len(batch) * new_tokens / (time.perf_counter() - start)


def transformers_tokens_per_s(reference, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=reference.config.eos_token_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == len(prompt) + new_tokens
    return new_tokens / elapsed


def load_transformers(gguf: Path):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise RuntimeError("the comparison with transformers needs it: pip install transformers accelerate") from None
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("accelerate") is not None


class _TokenClock:
    """A `generate` streamer that stamps what it is handed: the prompt first, then each new token as its step ends."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersSide:
    """transformers' `generate` on the GGUF, float32, greedy: batch 1 only (a padded `generate` batch is no serving engine)."""

    max_batch = 1
    about = {"dtype": "float32", "batches": "batch 1 only: generate() pads a batch to its longest prompt and is no serving engine"}

    def __init__(self, gguf: Path) -> None:
        self.model = load_transformers(gguf)

    def _generate(self, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float], float]:
        """New tokens, the stamps of each, and the start."""
        ids = torch.tensor([prompt])
        clock = _TokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=self.model.config.eos_token_id, streamer=clock,
            )
        return out[0, len(prompt):].tolist(), clock.stamps[1:], start

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Decoded:
        if len(prompts) != 1:
            raise ValueError("transformers is measured at batch 1 only")
        tokens, stamps, _ = self._generate(prompts[0], new_tokens)
        return Decoded([b - a for a, b in zip(stamps, stamps[1:], strict=False)], [tokens])

    def first_token_s(self, prompt: list[int]) -> float:
        _, stamps, start = self._generate(prompt, 1)
        return stamps[0] - start


def load_to_first_token(model_name: str) -> dict[str, float]:
    """Seconds from a fresh interpreter's start to its imports, its loaded model and its first token."""
    done = subprocess.run([sys.executable, "-c", _FIRST_TOKEN, model_name], check=True, capture_output=True, text=True, timeout=300)
    t = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "import_s": round(t["imported"] - t["started"], 3),
        "load_s": round(t["loaded"] - t["imported"], 3),
        "load_to_first_token_s": round(t["first_token"] - t["started"], 3),
    }


def compare_with_transformers(model: Transformer, model_name: str, gguf: Path, *, new_tokens: int, prompt_len: int, repeats: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(EngineConfig().effective_torch_threads())
    try:
        return _compare(model, model_name, gguf, new_tokens=new_tokens, prompt_len=prompt_len, repeats=repeats)
    finally:
        torch.set_num_threads(threads)


def _compare(model: Transformer, model_name: str, gguf: Path, *, new_tokens: int, prompt_len: int, repeats: int) -> dict:
    reference = load_transformers(gguf)
    batch = prompts(model, STREAMS, prompt_len)
    # Warm-up of both sides: allocator, kernels, transformers' generation config.
    engine_tokens_per_s(model, batch[:1], 4)
    engine_tokens_per_s(model, batch, 4)
    transformers_tokens_per_s(reference, batch[0], 4)
    runs: dict[str, list[float]] = {"transformers_batch1": [], "engine_batch1": [], "engine_batch16": [], "deterministic_batch1": []}
    for _ in range(repeats):
        runs["transformers_batch1"].append(transformers_tokens_per_s(reference, batch[0], new_tokens))
        runs["engine_batch1"].append(engine_tokens_per_s(model, batch[:1], new_tokens))
        runs["engine_batch16"].append(engine_tokens_per_s(model, batch, new_tokens))
        runs["deterministic_batch1"].append(engine_tokens_per_s(model, batch[:1], new_tokens, deterministic=True))
    med = {k: statistics.median(v) for k, v in runs.items()}
    timing = load_to_first_token(model_name)
    figures = {
        "torch_threads": torch.get_num_threads(),
        "transformers_batch1_tokens_per_s": round(med["transformers_batch1"], 2),
        "engine_batch1_tokens_per_s": round(med["engine_batch1"], 2),
        f"engine_batch{STREAMS}_aggregate_tokens_per_s": round(med["engine_batch16"], 2),
        # Batch-invariant numerics (`phalanx up`'s default) pad every matmul to 4 rows: information, not a goal.
        "engine_deterministic_batch1_tokens_per_s": round(med["deterministic_batch1"], 2),
        "batch1_ratio": round(med["engine_batch1"] / med["transformers_batch1"], 3),
        "batch16_ratio": round(med["engine_batch16"] / med["transformers_batch1"], 3),
        **timing,
    }
    met = {
        "batch1_ratio": figures["batch1_ratio"] >= GOALS["batch1_ratio"],
        "batch16_ratio": figures["batch16_ratio"] >= GOALS["batch16_ratio"],
        "load_to_first_token_s": timing["load_to_first_token_s"] < GOALS["load_to_first_token_s"],
    }
    return {"figures": figures, "goals": GOALS, "met": met}
