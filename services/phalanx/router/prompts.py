"""A Generate request's prompt as token ids, checked against the router's and the workers' limits. No I/O.

The prompt is text (tokenized here, one placeholder per media marker) or
token ids; either way it must be non-empty, within ``max_prompt_tokens``,
and leave room for ``max_tokens`` in the smallest context of the registered
workers. Every refusal is an InvalidRequestError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping

from phalanx._proto import common_pb2, router_pb2
from phalanx.common.errors import InvalidRequestError
from phalanx.model.params import SamplingParams, sampling_from_proto
from phalanx.model.tokenizer import Tokenizer
from phalanx.router.config import RouterConfig
from phalanx.router.media import split_on_markers

__all__ = ["context_limit", "prompt_with_placeholders", "request_prompt"]


def context_limit(registrations: Mapping[str, common_pb2.WorkerRegistration]) -> int:
    """The smallest context of the registered workers (a request must fit any of them); 0 when none says."""
    return min((r.max_model_len for r in registrations.values() if r.max_model_len), default=0)


def prompt_with_placeholders(text: str, items: int, tokenizer: Tokenizer, *, marker: str, placeholder: int) -> list[int]:
    """The text's tokens with one placeholder per media marker; no markers: the media go first."""
    pieces = split_on_markers(text, marker)
    if len(pieces) == 1:
        pieces = [""] * items + pieces  # no markers: every item before the text (after BOS)
    if len(pieces) - 1 != items:
        raise InvalidRequestError("text", f"{len(pieces) - 1} media markers for {items} media items")
    ids = tokenizer.encode(pieces[0])
    for piece in pieces[1:]:
        ids.append(placeholder)
        ids += tokenizer.encode(piece, add_bos=False) if piece else []
    return ids


def request_prompt(
    request: router_pb2.GenerateRequest, tokenizer: Tokenizer, config: RouterConfig, *, context: int,
) -> tuple[list[int], SamplingParams]:
    """The request's prompt ids and sampling parameters; `context`: the workers' context_limit (0: none stated)."""
    which = request.WhichOneof("prompt")
    if which == "text" and request.text and request.media:
        prompt_ids = prompt_with_placeholders(
            request.text, len(request.media), tokenizer, marker=config.media_marker, placeholder=config.media_placeholder_token_id,
        )
    elif which == "text" and request.text:
        prompt_ids = tokenizer.encode(request.text)
    elif which == "tokens":
        prompt_ids = list(request.tokens.ids)
        bad = [t for t in prompt_ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise InvalidRequestError("prompt.tokens", f"ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})")
    else:
        prompt_ids = []
    if not prompt_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    if len(prompt_ids) > config.max_prompt_tokens:
        raise InvalidRequestError("prompt", f"{len(prompt_ids)} tokens exceed the limit of {config.max_prompt_tokens}")
    params = sampling_from_proto(request.sampling)
    params.validate(tokenizer.vocab_size)
    if context and len(prompt_ids) + params.max_tokens > context:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of {context} tokens",
        )
    return prompt_ids, params
