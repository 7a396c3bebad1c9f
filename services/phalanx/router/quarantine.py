"""The poison-request quarantine: ends a request that keeps killing its workers, and refuses it fleet-wide for a while.

`CrashPolicy` (router/crashes.py) decides which request a run of worker
crashes names; this module executes it. A quarantined request ends with
REQUEST_QUARANTINED (FAILED_PRECONDITION; the tokens the client has stay
valid), and its *fingerprint* (model, prompt tokens, media digests, sampling:
what makes a retry the same request) goes into etcd under
``/phalanx/v1/quarantine/<fingerprint>`` with a lease of the quarantine's TTL.
Every router follows that prefix and refuses a request with a quarantined
fingerprint before it routes it, so a client's retries stop at the gate and
reach no worker. ``phalanx quarantine list|release`` shows and lifts them.

etcd being away must not stop serving: the refusal then holds on this router
alone (it keeps what it quarantined) and the put is retried by no one; the
request's next crashes would quarantine it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from array import array
from collections.abc import Callable, Iterable, Sequence

import aetcd
import grpc

from phalanx._proto import common_pb2, router_pb2
from phalanx.common.config import EtcdConfig
from phalanx.common.discovery import EtcdDirectory, decode_json, encode_json
from phalanx.common.errors import RequestQuarantinedError
from phalanx.common.lease import TRANSIENT_ERRORS, connect_etcd
from phalanx.common.subjects import QUARANTINE_PREFIX, validate_worker_id
from phalanx.router.config import RouterConfig
from phalanx.router.crashes import Crashed, CrashPolicy, Held, Move, Placed, Placing, Quarantine, Released, Streamed
from phalanx.router.metrics import RouterMetrics

__all__ = ["QuarantineStore", "RequestQuarantine", "is_crash", "list_quarantined", "release_quarantined", "request_fingerprint"]

log = logging.getLogger(__name__)

# A dead process's broken stream: no status a living worker would send (a refusal or a drain carries its reasons).
_CRASH_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
_PUT_TIMEOUT_S = 2.0
_PUT_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, TimeoutError)


def is_crash(error: grpc.aio.AioRpcError) -> bool:
    """Whether a worker stream broke as its process's death breaks it (not a refusal, which carries google.rpc details)."""
    if error.code() not in _CRASH_CODES:
        return False
    return not any(key == "grpc-status-details-bin" for key, _ in error.trailing_metadata() or ())


def request_fingerprint(
    model: str, prompt_ids: Sequence[int], media: Iterable[router_pb2.MediaInput], sampling: common_pb2.SamplingParams | None
) -> str:
    """What makes two requests the same poison: the model, the prompt's tokens, each media item's digest, the sampling."""
    digest = hashlib.sha256(b"phalanx-request-fingerprint-v1\0")
    digest.update(model.encode() + b"\0")
    digest.update(len(prompt_ids).to_bytes(8, "little") + array("q", prompt_ids).tobytes())
    for item in media:
        source = item.data if item.WhichOneof("source") == "data" else item.uri.encode()
        digest.update(int(item.kind).to_bytes(4, "little") + hashlib.sha256(source).digest())
    digest.update(b"\0" + (sampling.SerializeToString(deterministic=True) if sampling is not None else b""))
    return digest.hexdigest()[:32]


class QuarantineStore:
    """The quarantined fingerprints of the fleet: etcd keys under leases of the TTL, followed by every router."""

    def __init__(self, config: EtcdConfig) -> None:
        self._client = connect_etcd(config)
        self._directory = EtcdDirectory(config, prefix=QUARANTINE_PREFIX, message_type=router_pb2.QuarantineRecord)
        self.records: dict[str, router_pb2.QuarantineRecord] = {}
        self.on_change: Callable[[], None] = lambda: None

    async def start(self) -> None:
        self.records.update(await self._directory.list())
        self.on_change()

    async def follow(self) -> None:
        """Applies every change (a router's quarantine, an operator's release, a lease's end), until cancelled."""
        await self._directory.follow(self._apply)

    def _apply(self, kind: str, fingerprint: str, record: router_pb2.QuarantineRecord | None) -> None:
        if kind == "put" and record is not None:
            self.records[fingerprint] = record
        else:
            self.records.pop(fingerprint, None)
        self.on_change()

    def get(self, fingerprint: str) -> router_pb2.QuarantineRecord | None:
        record = self.records.get(fingerprint)
        if record is not None and record.quarantined_at + record.ttl_s < time.time():
            return None  # its lease ends about now: the delete is on its way
        return record

    async def add(self, record: router_pb2.QuarantineRecord) -> None:
        """Refuse `record`'s fingerprint here at once, and everywhere once etcd has it."""
        self.records[record.fingerprint] = record
        self.on_change()
        try:
            async with asyncio.timeout(_PUT_TIMEOUT_S):
                lease = await self._client.lease(record.ttl_s)
                await self._client.put((QUARANTINE_PREFIX + record.fingerprint).encode(), encode_json(record), lease=lease.id)
        except _PUT_ERRORS as error:
            log.warning("could not store quarantined fingerprint %s in etcd (%s): refused by this router only", record.fingerprint, error)

    async def close(self) -> None:
        await self._directory.close()
        await self._client.close()


class RequestQuarantine:
    """Executes the crash policy for one router's relays: follows where requests run, ends a poison, guards the gate."""

    def __init__(self, config: RouterConfig, router_id: str, metrics: RouterMetrics, store: QuarantineStore | None) -> None:
        self.enabled = config.quarantine_after_crashes > 0
        self._policy = CrashPolicy(after_crashes=max(config.quarantine_after_crashes, 1), probation_s=config.quarantine_probation_s)
        self._config = config
        self._router_id = router_id
        self._metrics = metrics
        self._store = store
        self._crashed_on: dict[str, list[str]] = {}  # request id -> the workers that died under it, oldest first
        self._puts: set[asyncio.Task[None]] = set()
        if store is not None:
            store.on_change = lambda: metrics.quarantined_fingerprints.set(len(store.records))

    def gate(self, fingerprint: str) -> None:
        """Refuses a request whose fingerprint is quarantined (raises RequestQuarantinedError)."""
        record = self._store.get(fingerprint) if self._store is not None and self.enabled else None
        if record is None:
            return
        self._metrics.quarantine_refusals.inc()
        expires_in = record.quarantined_at + record.ttl_s - time.time()
        raise RequestQuarantinedError(
            f"refused: the same request (fingerprint {fingerprint}) crashed {record.crashes} workers and is quarantined for "
            f"{expires_in:.0f} s more; change the request or ask an operator to release it", fingerprint=fingerprint,
            crashes=record.crashes, expires_in_s=expires_in,
        )

    def held(self, request_id: str, worker_id: str) -> None:
        self._policy.on(Held(request_id, worker_id))

    def streamed(self, request_id: str) -> None:
        """The request's worker streamed it a token (it is past its prefill there)."""
        self._policy.on(Streamed(request_id))

    def released(self, request_id: str) -> None:
        self._policy.on(Released(request_id))
        self._crashed_on.pop(request_id, None)

    def crashed(self, request_id: str, worker_id: str, *, fingerprint: str, tenant: str) -> None:
        """The request's stream broke as `worker_id`'s death breaks it; raises RequestQuarantinedError if that names it."""
        if not self.enabled:
            return
        opened = self._policy.deaths
        effects = self._policy.on(Crashed(request_id, worker_id, time.monotonic()))
        self._metrics.worker_crashes.inc(self._policy.deaths - opened)
        self._crashed_on.setdefault(request_id, []).append(worker_id)
        for effect in effects:
            if isinstance(effect, Quarantine):
                self._quarantine(effect, fingerprint, tenant)

    def _quarantine(self, effect: Quarantine, fingerprint: str, tenant: str) -> None:
        workers = self._crashed_on.get(effect.request_id, [])
        self._metrics.quarantined.inc()
        log.error("quarantined %s (fingerprint %s): the one common suspect of %d worker crashes (%s)", effect.request_id,
                  fingerprint or "unknown", effect.crashes, ", ".join(workers))
        if fingerprint and self._store is not None:
            record = router_pb2.QuarantineRecord(
                fingerprint=fingerprint, request_id=effect.request_id, model=self._config.model, crashes=effect.crashes,
                worker_ids=workers, router_id=self._router_id, quarantined_at=time.time(), ttl_s=self._config.quarantine_ttl_s,
                tenant=tenant,
            )
            task = asyncio.get_running_loop().create_task(self._store.add(record))
            self._puts.add(task)
            task.add_done_callback(self._puts.discard)
        raise RequestQuarantinedError(
            f"request {effect.request_id} was running on each of the {effect.crashes} workers that crashed under it "
            f"({', '.join(workers)}) and on no other request's every one: it is not moved again, and the same request is "
            f"refused for {self._config.quarantine_ttl_s} s", fingerprint=fingerprint, crashes=effect.crashes,
            expires_in_s=float(self._config.quarantine_ttl_s),
        )

    def placement(self, request_id: str, candidates: frozenset[str]) -> frozenset[str]:
        """The workers a request about to move should avoid, of `candidates`: where its crash-mates went."""
        if not self.enabled:
            return frozenset()
        (move,) = self._policy.on(Placing(request_id, candidates, time.monotonic()))
        assert isinstance(move, Move)  # a placement is always a move (nothing waits)
        return move.avoid

    def placed(self, request_id: str, worker_id: str) -> None:
        self._policy.on(Placed(request_id, worker_id, time.monotonic()))

    async def close(self) -> None:
        for task in self._puts:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._puts, return_exceptions=True)


# -- operator's view (`phalanx quarantine list|release`) ------------------------------------------
async def list_quarantined(client: aetcd.Client) -> list[router_pb2.QuarantineRecord]:
    """Every fingerprint refused now, the latest quarantine first."""
    result = await client.get_prefix(QUARANTINE_PREFIX.encode())
    records = [decode_json(kv.value, router_pb2.QuarantineRecord) for kv in result.kvs]
    return sorted(records, key=lambda r: -r.quarantined_at)


async def release_quarantined(client: aetcd.Client, fingerprint: str) -> bool:
    """Lift a fingerprint's quarantine on every router (they follow the key); False if it was not quarantined."""
    key = (QUARANTINE_PREFIX + validate_worker_id(fingerprint)).encode()
    if await client.get(key) is None:
        return False
    await client.delete(key)
    return True
