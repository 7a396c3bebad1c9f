"""Python SDK of the Phalanx router: token streams that survive router and worker failures.

    async with await Client.connect("127.0.0.1:50051", api_key=key) as client:
        async for chunk in client.generate("Hello", max_tokens=32):
            print(chunk.text, end="")

Every call retries on UNAVAILABLE; a broken Generate stream is resumed at
the next token, so each index is yielded exactly once. ``SyncClient`` is the
blocking twin.
"""

from phalanx.client._client import Client
from phalanx.client._config import RetryPolicy, TlsConfig
from phalanx.client._errors import (
    AuthenticationError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OverloadedError,
    PhalanxClientError,
    RequestCancelledError,
    RequestQuarantinedError,
    StreamGapError,
    UnavailableError,
)
from phalanx.client._options import GenerateOptions
from phalanx.client._stream import GenerateStream
from phalanx.client._sync import SyncClient, SyncGenerateStream
from phalanx.client._types import Chunk, Completion, FinishReason, Media, PositionLogprobs, Tier, TokenLogprob, WorkerHealth, WorkerInfo

__all__ = [
    "AuthenticationError",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "FinishReason",
    "GenerateOptions",
    "GenerateStream",
    "InternalError",
    "InvalidArgumentError",
    "Media",
    "NotFoundError",
    "OverloadedError",
    "PhalanxClientError",
    "PositionLogprobs",
    "RequestCancelledError",
    "RequestQuarantinedError",
    "RetryPolicy",
    "StreamGapError",
    "SyncClient",
    "SyncGenerateStream",
    "Tier",
    "TlsConfig",
    "TokenLogprob",
    "UnavailableError",
    "WorkerHealth",
    "WorkerInfo",
]
