"""`python -m phalanx.bench.disagg`: moving a prefilled prompt's KV to a decode worker against prefilling it there again.

Two real worker processes on this host (own NATS and etcd): a prefill worker and a decode worker of one model.
Per round, a prompt of `tokens` random token ids is prefilled on the prefill worker (its stream ends HANDED_BACK with
the KV parked, as in disaggregated serving); the decode worker's Restore then fetches that KV over a tensor channel
(`transfer_s`: the fetch alone, as the decode worker times it; `restore_s`: the whole Restore call, scatter into the
paged cache included). The baseline is the decode worker prefilling a fresh prompt of the same length (`reprefill_s`:
Generate to its first token, on an idle worker). Medians over `repeats` rounds after one warm-up round (which also
forms the channel). The disaggregation pays off when the transfer is a small fraction of the re-prefill.
"""

from __future__ import annotations

__all__ = ["main", "run_disagg_bench"]

import argparse
import asyncio
import json
import random
import statistics
import time

import grpc

from phalanx._proto import common_pb2, migration_pb2, worker_pb2, worker_pb2_grpc
from phalanx.common.config import EtcdConfig
from phalanx.launch.infra import EtcdServer, NatsServer
from phalanx.launch.stack import Stack

_HANDED_BACK = common_pb2.FINISH_REASON_HANDED_BACK
_TIMEOUT_S = 120.0


async def run_disagg_bench(model: str = "smollm2-135m-instruct", tokens: int = 1024, repeats: int = 3, seed: int = 0) -> dict:
    """Measure and return ``{"model", "tokens", "kv_bytes", "transfer_s", "restore_s", "reprefill_s", "prefill_s", "transfer_vs_reprefill"}``."""
    if tokens < 16 or repeats < 1:
        raise ValueError("need tokens >= 16 and repeats >= 1")
    rng = random.Random(seed)
    with NatsServer() as nats, EtcdServer() as etcd:
        stack = Stack(nats.url, EtcdConfig(endpoint=etcd.endpoint), model=model)
        try:
            env = {"PHALANX_ENGINE_MAX_MODEL_LEN": str(max(2048, 2 * tokens)), "PHALANX_WORKER_CHANNEL_MIN_BYTES": "0"}
            (prefill,), (decode,) = await asyncio.gather(
                stack.add_workers(1, "--fast", "--role", "prefill", env=env, timeout=_TIMEOUT_S),
                stack.add_workers(1, "--fast", "--role", "decode", env=env, timeout=_TIMEOUT_S),
            )
            async with grpc.aio.insecure_channel(prefill.address) as p_channel, grpc.aio.insecure_channel(decode.address) as d_channel:
                p, d = worker_pb2_grpc.WorkerServiceStub(p_channel), worker_pb2_grpc.WorkerServiceStub(d_channel)
                rounds = [await _round(p, d, rng, tokens, i) for i in range(repeats + 1)][1:]
        finally:
            await asyncio.to_thread(stack.stop)
    out: dict = {"model": model, "tokens": tokens, "repeats": repeats, "kv_bytes": rounds[0]["kv_bytes"]}
    for key in ("prefill_s", "transfer_s", "restore_s", "reprefill_s"):
        out[key] = statistics.median(r[key] for r in rounds)
    out["transfer_vs_reprefill"] = out["transfer_s"] / out["reprefill_s"]
    out["restore_vs_reprefill"] = out["restore_s"] / out["reprefill_s"]
    return out


async def _round(p: worker_pb2_grpc.WorkerServiceStub, d: worker_pb2_grpc.WorkerServiceStub, rng: random.Random, tokens: int, i: int) -> dict:
    sampling = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    ids = [rng.randrange(100, 30000) for _ in range(tokens)]
    start = time.perf_counter()
    handoff = None
    async for chunk in p.Generate(worker_pb2.GenerateRequest(request_id=f"moved-{i}", tokens=common_pb2.PromptTokens(ids=ids), sampling=sampling)):
        if chunk.finish_reason == _HANDED_BACK:
            handoff = chunk
            break
    prefill_s = time.perf_counter() - start
    if handoff is None or not handoff.handoff_kv_tokens:
        raise RuntimeError("the prefill worker did not hand the request back with its KV")
    item = migration_pb2.RestoreItem(
        state=handoff.handoff, seed=handoff.handoff.sampling.seed, method=migration_pb2.MIGRATION_METHOD_TRANSFER,
        kv_tokens=handoff.handoff_kv_tokens,
    )
    start = time.perf_counter()
    reply = await d.Restore(
        worker_pb2.RestoreRequest(items=[item], kv_source_address=handoff.handoff_source, timeout_s=60), timeout=_TIMEOUT_S
    )
    restore_s = time.perf_counter() - start
    if not reply.results or not reply.results[0].ok:
        raise RuntimeError(f"the decode worker refused the transfer: {reply}")
    await d.Cancel(worker_pb2.CancelRequest(request_id=f"moved-{i}"), timeout=10)
    fresh = [rng.randrange(100, 30000) for _ in range(tokens)]
    start = time.perf_counter()
    one = common_pb2.SamplingParams(max_tokens=1, ignore_eos=True)
    async for _ in d.Generate(worker_pb2.GenerateRequest(request_id=f"again-{i}", tokens=common_pb2.PromptTokens(ids=fresh), sampling=one)):
        break
    reprefill_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "transfer_s": reply.transfer_s, "restore_s": restore_s, "reprefill_s": reprefill_s,
            "kv_bytes": reply.kv_bytes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run_disagg_bench(args.model, args.tokens, args.repeats)), indent=2))


if __name__ == "__main__":
    main()
