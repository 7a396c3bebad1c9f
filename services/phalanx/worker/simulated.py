"""The simulated engine: the real engine (scheduling, paged KV accounting, prefix-cache hashes and KV events,
checkpoints, snapshots, migration) with a runner that replaces the model's forward.

`phalanx worker --engine sim --profile P.npz` runs it. No weights are loaded and nothing is computed: a step
lasts what the measured performance profile (planner/profile.py) says a real worker of the profiled model
takes for it, and tokens are a deterministic function of the request's prompt, the output position and,
for sampled requests, the request's seed. So one small box runs many workers whose capacity really adds up,
greedy output is the same on every simulated worker, and a request restored or migrated elsewhere continues
the same token sequence.

Its output is not a model's: a simulated worker never stands in for the real engine where correctness is
tested. It says what it is everywhere: its model is named `sim:<profiled model>` (registration, ListWorkers,
load reports) and its model version starts with `sim:`, so the migration service never mixes its requests
with a real worker's.

Step time: the step's prefill tokens take the profile's TTFT for a prompt of that many tokens, and its decodes
take the profile's ITL at the batch's decode concurrency and mean context; a mixed step takes both. The
sleep covers what the step's bookkeeping did not already spend.

It never imports torch (a test pins that): its KV lives in a numpy array (SimulatedKvCache), its sampler's
generator is never drawn from, and the worker gives it no tensor channels. Importing torch was most of a simulated
worker's start time (seconds on a loaded box) and of its memory.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.model.config import BUILTIN_MODELS, SIM_PREFIX, ModelConfig, model_tokenizer, simulated_model_name
from phalanx.model.kv_cache import KvCacheManager
from phalanx.model.tokenizer import Tokenizer
from phalanx.planner.profile import PerformanceProfile, load_profile
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import SampledToken
from phalanx.worker.faults import FaultState
from phalanx.worker.sequence import Sequence

# The measured profile of phalanx-tiny-moe on a 2-core CPU box shipped with Phalanx (docs/planner.md says how it was made).
DEFAULT_PROFILE = "tiny-moe-cpu.npz"
# Output tokens are drawn from the ids of these characters: readable text, and never a special token (EOS included,
# so a request runs to its max_tokens unless a stop string or stop token ends it).
_ALPHABET = "abcdefghijklmnopqrstuvwxyz "


_SIM_TOP_LOGIT = 10.0
_SIM_TOP_MARGIN = 5.0


def default_profile_path() -> Path:
    return Path(str(resources.files("phalanx.planner").joinpath("profiles", DEFAULT_PROFILE)))


def prompt_digest(prompt_ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16).digest()


def simulated_token(prompt_ids: list[int], index: int, seed: int, alphabet: list[int]) -> int:
    """The token at output position `index` of a request with this prompt: the same on every simulated worker."""
    digest = hashlib.blake2b(prompt_digest(prompt_ids) + index.to_bytes(8, "little") + seed.to_bytes(8, "little"), digest_size=8).digest()
    return alphabet[int.from_bytes(digest, "little") % len(alphabet)]


def token_alphabet(tokenizer: Tokenizer) -> list[int]:
    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    ids = {t for ch in _ALPHABET for t in tokenizer.encode(ch, add_bos=False)} - specials
    if not ids:
        raise ValueError("the tokenizer encodes no plain letters; a simulated worker cannot pick tokens")
    return sorted(ids)


@dataclass
class SimulatedModel:
    """What the engine and the worker read of a model (config, tokenizer, dtype, device, version), with no weights.

    Its KV layout is one layer of one head of one value per position: the engine's block accounting, snapshots,
    checkpoints and KV transfers run unchanged on a cache of a few kilobytes."""

    config: ModelConfig
    tokenizer: Tokenizer
    version: str
    profile: PerformanceProfile
    # The engine reads the item size and the worker the name ("float32" in its registration and checkpoint layout).
    dtype: np.dtype = np.dtype(np.float32)
    device: str = "cpu"
    # No logits: requests that ask for log-probabilities are refused.
    computes_logprobs = False

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return iter(())  # nothing for a WEIGHTS corruption to corrupt

    def new_kv_cache(self, num_blocks: int, block_size: int) -> SimulatedKvCache:
        """The engine's KV cache for this model: numpy, not torch."""
        c = self.config
        return SimulatedKvCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)


class SimulatedKvCache:
    """KvCacheTensors' interface on a numpy array: [layers, 2, blocks, block_size, heads, dim], all 1 but blocks.

    Nothing computes KV in a simulated worker, but it moves like real KV: checkpoints gather it, restores and transfers
    scatter it, so those paths run on a cache of a few kilobytes without torch.
    """

    simulated = True  # the worker's restore path receives KV into `empty` arrays, not its torch buffer pool

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> None:
        self.block_size = block_size
        self.data = np.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def bytes_per_block(self) -> int:
        return int(self.data[:, :, 0].nbytes)

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=self.data.dtype)

    def _flat(self) -> np.ndarray:
        d = self.data
        return d.reshape(d.shape[0], 2, d.shape[2] * d.shape[3], *d.shape[4:])

    def _slots(self, kv: KvCacheManager, seq_id: str, start: int, end: int) -> np.ndarray:
        table = np.asarray(kv.block_table(seq_id), dtype=np.int64)
        positions = np.arange(start, end)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def gather_ranges(self, kv: KvCacheManager, ranges: list[tuple[str, int, int]]) -> np.ndarray:
        slots = np.concatenate([self._slots(kv, seq_id, start, end) for seq_id, start, end in ranges])
        return self._flat()[:, :, slots]  # fancy indexing: a copy

    def scatter_range(self, kv: KvCacheManager, seq_id: str, start: int, end: int, values: Any) -> None:
        flat = self._flat()
        expected = (*flat.shape[:2], end - start, *flat.shape[3:])
        if tuple(values.shape) != expected:
            raise ValueError(f"KV of shape {tuple(values.shape)} does not fit {expected}")
        flat[:, :, self._slots(kv, seq_id, start, end)] = np.asarray(values, dtype=self.data.dtype)


class SimulatedRunner:
    """The engine's ModelRunner for a simulated worker: deterministic tokens, step times from the profile."""

    def __init__(
        self, profile: PerformanceProfile, alphabet: list[int], *, clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.profile = profile
        self.alphabet = alphabet
        self._clock = clock
        self._sleep = sleep
        self.simulated_seconds = 0.0  # what the profile said, summed over steps (for tests and load reports)

    def step_seconds(self, prefill_tokens: int, decode_contexts: list[int]) -> float:
        """How long a real worker of the profiled model takes for a step of this shape."""
        seconds = self.profile.prefill_ttft(prefill_tokens) if prefill_tokens else 0.0
        if decode_contexts:
            seconds += self.profile.decode_itl(sum(decode_contexts) / len(decode_contexts), len(decode_contexts))
        return seconds

    def run(self, batch: list[tuple[Sequence, int]], faults: FaultState | None) -> list[SampledToken]:
        start = self._clock()
        prefill_tokens = 0
        decode_contexts: list[int] = []
        sampled: list[SampledToken] = []
        for seq, n in batch:
            if n == 1 and seq.num_computed >= len(seq.prompt_ids):
                decode_contexts.append(seq.num_computed + 1)
            else:
                prefill_tokens += n
            if seq.num_computed + n == seq.num_tokens:
                seed = 0 if seq.params.greedy else seq.sampler.seed
                token = simulated_token(seq.prompt_ids, len(seq.output_ids), seed, self.alphabet)
                # Health's canaries record the top logit and its margin; a simulated model has neither, so it reports fixed
                # ones (the same on every worker: calibration and every later canary agree).
                top, margin = (_SIM_TOP_LOGIT, _SIM_TOP_MARGIN) if seq.record_top_logits else (None, None)
                sampled.append((token, top, margin, None))
        seconds = self.step_seconds(prefill_tokens, decode_contexts)
        self.simulated_seconds += seconds
        remaining = seconds - (self._clock() - start)
        if remaining > 0:
            self._sleep(remaining)
        return sampled


def load_simulated(config: EngineConfig) -> tuple[SimulatedModel, SimulatedRunner]:
    """The simulated model of `config.profile` (the shipped profile when empty) and its runner."""
    path = Path(config.profile) if config.profile else default_profile_path()
    profile = load_profile(path)
    tokenizer = model_tokenizer(profile.model)
    base = BUILTIN_MODELS.get(profile.model)
    positions = base.max_position_embeddings if base is not None else config.max_model_len
    model_config = ModelConfig(
        name=simulated_model_name(profile.model), vocab_size=tokenizer.vocab_size, hidden_size=1, intermediate_size=1,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, max_position_embeddings=positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    if base is not None:
        model_config = replace(model_config, vocab_size=base.vocab_size)
    digest = hashlib.blake2b(path.read_bytes(), digest_size=6).hexdigest()
    model = SimulatedModel(model_config, tokenizer, version=f"{SIM_PREFIX}{profile.model}:{path.stem}:{digest}", profile=profile)
    runner = SimulatedRunner(profile, token_alphabet(tokenizer))
    # Builds the interpolators (and imports scipy) now, while loading, not in the first step a request waits for: seconds
    # on a busy box, and a first step that long would also make the worker look slow to the routers for a while.
    runner.step_seconds(1, [1])
    return model, runner
