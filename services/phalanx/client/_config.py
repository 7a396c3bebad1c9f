"""Connection options: the retry policy and TLS settings."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RetryPolicy", "TlsConfig"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the SDK recovers a broken call.

    ``max_attempts`` bounds the calls made in a row without receiving a new
    token (the first call included); each token received starts the count
    and the backoff afresh, so a long stream survives any number of breaks as
    long as it makes progress. Between attempts the SDK sleeps a capped
    exponential backoff with jitter, or the server's RetryInfo delay when it is
    longer. ``retry_overloaded`` also retries RESOURCE_EXHAUSTED, and only
    before the first token.
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    retry_overloaded: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1:
            raise ValueError("multiplier must be at least 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")

    def backoff_s(self, failures: int, *, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(0, failures - 1))
        # Subtractive jitter keeps the cap a cap while spreading clients apart.
        return base * (1 - self.jitter * (rng or random).random())


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS for the router channel; ``None`` roots means the system trust store.

    ``private_key`` and ``certificate_chain`` (PEM) enable mutual TLS.
    ``server_name_override`` checks the server certificate against this name
    instead of the target's host (testing, or routers reached by IP).
    """

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name_override: str | None = None

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], *, server_name_override: str | None = "phalanx.internal") -> TlsConfig:
        """Mutual TLS with the files of ``phalanx certs init`` or a cert-manager secret: ``tls.crt``, ``tls.key``, ``ca.crt``.

        Phalanx routers' certificates name ``phalanx.internal`` (pass None to check the target's host instead).
        """
        base = Path(directory)
        return cls(
            root_certificates=(base / "ca.crt").read_bytes(),
            private_key=(base / "tls.key").read_bytes(),
            certificate_chain=(base / "tls.crt").read_bytes(),
            server_name_override=server_name_override,
        )
