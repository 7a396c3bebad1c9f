"""The leader (rank 0) of a tensor-parallel worker: starts the follower ranks, drives them, and fail-stops the group.

To the rest of the system a TP group is one worker: the leader registers,
serves gRPC, schedules and samples; the followers only compute. The Engine
runs unchanged on two stand-ins built here: `TensorParallelModel`, whose
forward first sends the followers the same step, and
`TensorParallelKvCache`, whose gather and scatter move every rank's KV
heads, so what leaves or enters the worker (checkpoints, transfers,
restores) always has the model's full KV layout. All of it runs on the
engine thread, which is what keeps the commands in one order on every rank.

The group is one failure domain. When a rank dies, or a collective fails or
times out, the leader fail-stops: it kills its followers and exits
(FAILURE_EXIT_CODE) without draining. A drain would park requests and offer
their KV for transfer, and with a shard gone that KV would lack half the
heads; exiting instead makes the group look like a crashed worker (its
streams break, its lease lapses), and migration restores its requests from
the checkpoint store, whose segments the leader gathered from all ranks in
one collective, or re-prefills them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import NoReturn

import torch

from phalanx.common.children import pdeathsig_preexec
from phalanx.model.attention import PagedAttention
from phalanx.model.kv_cache import BLOCK_SIZE, KvCacheTensors, SlotRanges
from phalanx.model.tensor_parallel import check_shardable, local_kv_heads, shard_model
from phalanx.model.transformer import Transformer
from phalanx.worker.config import EngineConfig
from phalanx.worker.tp_group import FOLLOWER_CONFIG_ENV, GROUP_FORM_TIMEOUT_S, Command, StepBatch, TensorParallelError, TpGroup, listening_socket

log = logging.getLogger(__name__)

FAILURE_EXIT_CODE = 3


class TensorParallelLeader:
    """Rank 0: owns the follower processes and the group; any failure of either ends this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.group: TpGroup | None = None
        self.followers: list[subprocess.Popen] = []
        self._listener: socket.socket | None = None
        self._closing = False
        self._failing = threading.Lock()

    @property
    def formed(self) -> TpGroup:
        """The group, once connect() formed it."""
        assert self.group is not None, "used before connect()"
        return self.group

    def start_followers(self, model: Transformer) -> None:
        """Starts ranks 1..size-1 as processes of their own; call it from a long-lived thread (the main one).

        They get PDEATHSIG, which the kernel sends when the *thread* that
        forked them ends, so a short-lived worker thread would take them down.
        """
        check_shardable(model.config, self.size)
        listener = self._listener = listening_socket()
        port = listener.getsockname()[1]
        env = {
            **os.environ,
            FOLLOWER_CONFIG_ENV: self.config.model_dump_json(),
            # They start while gRPC runs here; grpcio's fork handlers would abort them now and then.
            "GRPC_ENABLE_FORK_SUPPORT": "false",
        }
        for rank in range(1, self.size):
            process = subprocess.Popen(
                [sys.executable, "-m", "phalanx.worker.tp_follower", "--rank", str(rank), "--size", str(self.size), "--port", str(port)],
                env=env, start_new_session=True, preexec_fn=pdeathsig_preexec(),  # noqa: PLW1509 - only prctl
            )
            self.followers.append(process)
            threading.Thread(target=self._watch, args=(rank, process), name=f"phalanx-tp-watch-{rank}", daemon=True).start()

    def connect(self, model: Transformer) -> tuple[TensorParallelModel, TensorParallelKvCache]:
        """Forms the group (blocking: the followers load the model first), shards `model`; returns the Engine's stand-ins."""
        listener, self._listener = self._listener, None
        assert listener is not None, "connect() before start_followers()"
        self.group = self.guard(
            TpGroup.join, rank=0, size=self.size, port=listener.getsockname()[1], timeout_s=self.config.tensor_parallel_timeout_s,
            form_timeout_s=GROUP_FORM_TIMEOUT_S, listener=listener,
        )
        group = self.group
        shard_model(model, 0, self.size, lambda tensor: self.guard(group.all_gather, tensor))
        c = model.config
        local = KvCacheTensors(
            c.num_layers, self.config.num_kv_blocks, BLOCK_SIZE, local_kv_heads(c, self.size), c.head_dim, dtype=model.dtype, device=model.device
        )
        log.info("tensor-parallel group of %d formed; followers %s", self.size, [p.pid for p in self.followers])
        return TensorParallelModel(model, self), TensorParallelKvCache(local, self)

    def guard(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), fail-stopping the group on a TensorParallelError."""
        try:
            return fn(*args, **kwargs)
        except TensorParallelError as exc:
            self.fail_stop(str(exc))

    def fail_stop(self, reason: str) -> NoReturn:
        """Kills the followers and ends this process now: no drain, no handoff, nothing more served."""
        with self._failing:  # one caller does it; another (a watcher, the engine thread) waits for the exit
            log.critical("tensor-parallel group failed, stopping every rank: %s", reason)
            self._kill_followers()
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(FAILURE_EXIT_CODE)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the followers cleanly (SHUTDOWN, then wait); call it once the engine thread has ended. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self.group is None:  # never formed (the worker failed to start): nobody would hear a SHUTDOWN
            self._kill_followers()
            return
        try:
            self.group.send_command(Command.SHUTDOWN)
        except TensorParallelError as exc:
            log.warning("tensor-parallel shutdown: %s", exc)
        for process in self.followers:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower %d did not stop in %.0f s; killing it", process.pid, timeout_s)
                self._kill(process)
        self.group.close()

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        # A follower that exits on its own is a lost shard, even while the group idles (no collective to fail).
        code = process.wait()
        if not self._closing:
            self.fail_stop(f"follower rank {rank} (pid {process.pid}) exited with {code}")

    def _kill_followers(self) -> None:
        self._closing = True
        for process in self.followers:
            self._kill(process)

    @staticmethod
    def _kill(process: subprocess.Popen) -> None:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its own session and group (start_new_session): nothing of ours besides it
            except ProcessLookupError:
                pass
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel follower %d survived SIGKILL", process.pid)


class TensorParallelModel:
    """The leader's shard as the Engine sees it: every forward first sends the followers the same step."""

    def __init__(self, model: Transformer, leader: TensorParallelLeader) -> None:
        self._model = model
        self._leader = leader

    # The followers' step batch carries token ids only: the engine refuses media requests on a group.
    takes_input_embeds = False

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor, backend, *, invariant: bool = False) -> torch.Tensor:
        if not isinstance(backend, PagedAttention):
            raise TypeError("a tensor-parallel model runs over the paged KV cache only")
        sizes, payload = StepBatch(token_ids, positions, backend.slot_mapping, backend.chunks, invariant).pack()
        group = self._leader.formed
        self._leader.guard(group.send_command, Command.STEP, sizes, payload)
        return self._model.hidden_states(token_ids, positions, backend, invariant=invariant)


class TensorParallelKvCache(SlotRanges):
    """KvCacheTensors' interface over the group: `data` holds this rank's heads; gather and scatter move all heads."""

    def __init__(self, local: KvCacheTensors, leader: TensorParallelLeader) -> None:
        self.local = local
        self.data = local.data
        self._leader = leader

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape of the KV of the whole group (what gather returns and scatter takes, per slot)."""
        shape = list(self.data.shape)
        shape[4] *= self._leader.size
        return tuple(shape)

    @property
    def bytes_per_block(self) -> int:
        return self.local.bytes_per_block * self._leader.size

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of token slots, every rank's heads: [layers, 2, len(slots), kv_heads, head_dim], a copy."""
        slots = slots.to("cpu", torch.int64)
        if not len(slots):
            return torch.empty((self.full_shape[0], 2, 0, *self.full_shape[4:]), dtype=self.data.dtype, device=self.data.device)
        return self._leader.guard(self._gather, slots)

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        group = self._leader.formed
        group.send_command(Command.GATHER, (), slots)
        parts = group.gather_to_leader(self.local.gather(slots).cpu())
        assert parts is not None  # this is the leader
        return torch.cat(parts, dim=3).to(self.data.device)

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Writes [layers, 2, len(slots), kv_heads, head_dim] (all heads) into the token slots of every rank."""
        full = self.full_shape
        expected = (full[0], 2, len(slots), *full[4:])
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit {expected}")  # before any collective: the group is fine
        if not len(slots):
            return
        parts = [p.contiguous() for p in kv.to("cpu", self.data.dtype).chunk(self._leader.size, dim=3)]
        self._leader.guard(self._scatter, slots.to("cpu", torch.int64), parts)

    def _scatter(self, slots: torch.Tensor, parts: list[torch.Tensor]) -> None:
        group = self._leader.formed
        group.send_command(Command.SCATTER, (), slots)
        mine = torch.empty_like(parts[0])
        group.scatter_from_leader(mine, parts)
        self.local.scatter(slots, mine)
