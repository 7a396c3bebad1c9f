"""llama.cpp's seat in the side-by-side (phalanx.bench.engine_side_by_side), through llama-cpp-python's low-level API.

The high-level `Llama` class runs one sequence; a serving comparison needs
llama.cpp's own batching, as its `llama-batched` example does it: one
context with `n_seq_max` sequences in a unified KV (any sequence may take
the whole context, so a lone 4,096-token prompt fits beside the batch
sizing), and one `llama_decode` per step carrying a token of every
sequence. Greedy is an argmax over each sequence's logits, as Phalanx's
engine samples on its side of the step.

llama-cpp-python is optional (the `bench` extra; docs/development.md says
how to build it): `llama_cpp_version()` is None where it is not installed.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.bench.engine_side_by_side import Decoded

# Kept referenced for as long as the process lives: llama.cpp calls it from C.
_SILENT: Any = None


def llama_cpp_version() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    return importlib.metadata.version("llama-cpp-python")


def _silence(ll: Any) -> None:
    """llama.cpp logs every load and context to stderr; the bench prints JSON only."""
    global _SILENT
    if _SILENT is None:
        _SILENT = ll.llama_log_callback(lambda level, text, user_data: None)
        ll.llama_log_set(_SILENT, ctypes.c_void_p(0))


class LlamaCppSide:
    """One llama.cpp context on the GGUF, reused across runs (its memory cleared before each)."""

    def __init__(self, gguf: Path, *, threads: int, max_batch: int, n_ctx: int) -> None:
        import llama_cpp as ll

        self.ll = ll
        _silence(ll)
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = ll.llama_context_default_params()
        # Unified: the cells are shared, so n_ctx is what the largest run holds at once, not per sequence.
        params.n_ctx = n_ctx
        params.n_batch = params.n_ctx  # a whole prefill (all prompts of a batch, or one long prompt) in one llama_decode
        params.n_seq_max = max_batch
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self.max_batch = max_batch
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.about = {"version": llama_cpp_version(), "dtype": "the GGUF's own (quantized)", "n_ctx": params.n_ctx, "kv_unified": True}

    def close(self) -> None:
        if self.ctx:
            self.ll.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.ll.llama_model_free(self.model)
            self.model = None

    def _run(self, pieces: list[tuple[int, list[int], int]]) -> list[int]:
        """One llama_decode of (sequence, tokens, first position) pieces; the argmax after each piece's last token."""
        ll = self.ll
        total = sum(len(tokens) for _, tokens, _ in pieces)
        batch = ll.llama_batch_init(total, 0, 1)
        try:
            last = []
            k = 0
            for seq, tokens, first_pos in pieces:
                for offset, token in enumerate(tokens):
                    batch.token[k] = token
                    batch.pos[k] = first_pos + offset
                    batch.n_seq_id[k] = 1
                    batch.seq_id[k][0] = seq
                    batch.logits[k] = offset == len(tokens) - 1
                    k += 1
                last.append(k - 1)
            batch.n_tokens = total
            code = ll.llama_decode(self.ctx, batch)
            if code != 0:
                raise RuntimeError(f"llama_decode returned {code}")
            return [int(np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax()) for i in last]
        finally:
            ll.llama_batch_free(batch)

    def _clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Decoded:
        self._clear()
        next_ids = self._run([(seq, prompt, 0) for seq, prompt in enumerate(prompts)])
        tokens = [[t] for t in next_ids]
        steps = []
        for step in range(new_tokens - 1):
            start = time.perf_counter()
            next_ids = self._run([(seq, [next_ids[seq]], len(prompt) + step) for seq, prompt in enumerate(prompts)])
            steps.append(time.perf_counter() - start)
            for seq, token in enumerate(next_ids):
                tokens[seq].append(token)
        return Decoded(steps, tokens)

    def first_token_s(self, prompt: list[int]) -> float:
        self._clear()
        start = time.perf_counter()
        self._run([(0, prompt, 0)])
        return time.perf_counter() - start
