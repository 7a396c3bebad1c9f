"""`phalanx chat`: an interactive conversation through the router, with the model's chat template, streamed."""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from phalanx.cli.status import INTERACTIVE_RETRY
from phalanx.client import Client, PhalanxClientError
from phalanx.common.errors import InvalidRequestError
from phalanx.common.tls import sdk_tls
from phalanx.model.chat import ChatPrompts

__all__ = ["run_chat"]

_LIST_WORKERS_TIMEOUT_S = 10.0
_HELP = "(an empty line or Ctrl-D ends the chat; /reset starts a new conversation)"


async def run_chat(
    target: str, *, model: str | None, system: str | None, api_key: str | None, max_tokens: int, temperature: float,
    stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
) -> int:
    """Read a user turn, stream the answer, repeat; the exit code."""
    try:
        async with await Client.connect(target, api_key=api_key, tls=sdk_tls(), retry=INTERACTIVE_RETRY) as client:
            if not model:
                workers = await client.list_workers(timeout=_LIST_WORKERS_TIMEOUT_S)
                models = sorted({w.model for w in workers if w.model})
                if not models:
                    print("error: the router has no worker yet, so the model (and its chat template) is unknown; pass --model", file=sys.stderr)
                    return 1
                model = models[0]
            prompts = await asyncio.to_thread(ChatPrompts.for_model, model)
            print(f"chatting with {model} through {target} {_HELP}", file=stdout, flush=True)
            start = [{"role": "system", "content": system}] if system else []
            messages = list(start)
            while True:
                print("> ", end="", file=stdout, flush=True)
                line = await asyncio.to_thread(stdin.readline)
                text = line.strip()
                if not text:
                    return 0
                if text == "/reset":
                    messages = list(start)
                    continue
                messages.append({"role": "user", "content": text})
                answer = []
                async for chunk in client.generate(prompts.render(messages), max_tokens=max_tokens, temperature=temperature):
                    answer.append(chunk.text)
                    print(chunk.text, end="", file=stdout, flush=True)
                print(file=stdout, flush=True)
                messages.append({"role": "assistant", "content": "".join(answer).strip()})
    except (PhalanxClientError, InvalidRequestError, ValueError) as error:
        print(f"error: {type(error).__name__}: {getattr(error, 'message', None) or error}", file=sys.stderr)
        return 1
