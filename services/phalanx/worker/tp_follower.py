"""A follower rank of a tensor-parallel worker (``python -m phalanx.worker.tp_follower``; the leader starts it).

It loads the same model as the leader (same name, seed or checkpoint), keeps
its shard, allocates a KV pool of its heads with as many blocks as the
leader's, and then runs the leader's commands in the order the leader's
engine thread issues them. It serves nothing else. SHUTDOWN ends it with 0;
any failure (the leader gone, a collective failing or timing out) ends it
non-zero, which the leader takes as the group's death.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from phalanx.model import load
from phalanx.model.attention import PagedAttention
from phalanx.model.kv_cache import BLOCK_SIZE, KvCacheTensors
from phalanx.model.tensor_parallel import local_kv_heads, shard_model
from phalanx.model.transformer import Transformer
from phalanx.worker.config import EngineConfig
from phalanx.worker.tp_group import FOLLOWER_CONFIG_ENV, GROUP_FORM_TIMEOUT_S, Command, StepBatch, TensorParallelError, TpGroup

log = logging.getLogger(__name__)


def serve(group: TpGroup, model: Transformer, cache: KvCacheTensors) -> None:
    """Runs the leader's commands until SHUTDOWN; raises TensorParallelError when the group breaks."""
    device = cache.data.device
    with torch.inference_mode():
        while True:
            command, sizes, payload = group.receive_command()
            if command is Command.STEP:
                batch = StepBatch.unpack(sizes, payload, device)
                backend = PagedAttention(cache.data, batch.slot_mapping, batch.chunks, invariant=batch.invariant)
                model.hidden_states(batch.token_ids, batch.positions, backend, invariant=batch.invariant)
            elif command is Command.GATHER:
                group.gather_to_leader(cache.gather(payload).cpu())
            elif command is Command.SCATTER:
                layers, _, _, _, heads, dim = cache.data.shape
                mine = torch.empty((layers, 2, len(payload), heads, dim), dtype=cache.data.dtype)
                group.scatter_from_leader(mine)
                cache.scatter(payload, mine)
            elif command is Command.SHUTDOWN:
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="Port of the leader's TCPStore on 127.0.0.1")
    args = parser.parse_args(argv)
    config = EngineConfig.model_validate_json(os.environ[FOLLOWER_CONFIG_ENV])
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp-rank-{args.rank}: %(message)s")
    if config.device == "cpu":
        # The leader's thread count: replicated parts (norms, the router gate) must give the same bits on every rank.
        torch.set_num_threads(config.effective_torch_threads())
    model = load(config.model, device=config.device, dtype=config.torch_dtype(), seed=config.seed)
    try:
        group = TpGroup.join(
            rank=args.rank, size=args.size, port=args.port, timeout_s=config.tensor_parallel_timeout_s, form_timeout_s=GROUP_FORM_TIMEOUT_S
        )
        shard_model(model, args.rank, args.size, group.all_gather)
        c = model.config
        cache = KvCacheTensors(
            c.num_layers, config.num_kv_blocks, BLOCK_SIZE, local_kv_heads(c, args.size), c.head_dim, dtype=model.dtype, device=model.device
        )
        serve(group, model, cache)
    except TensorParallelError as exc:
        log.error("%s; exiting", exc)
        return 1
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
