"""The process group of a tensor-parallel worker and the commands its leader sends over it.

One gloo group per TP worker, formed over a TCPStore that the leader (rank
0) hosts on 127.0.0.1; nothing else shares it, so a dead group breaks
nothing outside. Every collective has a timeout: a SIGKILLed peer fails a
pending op within tens of ms ("Connection closed by peer"), a hung one only
at the timeout. Followers wait for their next command without a limit (the
leader may idle for hours); they learn of a dead leader from its closed
connection, or from PDEATHSIG.

A command is a header of HEADER_LEN int64s (the command, its payload's
length and its sizes), broadcast by the leader, then its payload:
everything packed into one int64 tensor; KV then moves by gather or scatter.
"""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, BroadcastOptions, GatherOptions, ScatterOptions

from phalanx.common.errors import EngineDeadError
from phalanx.model.attention import SeqChunk

HEADER_LEN = 6
LEADER = 0
# The followers' EngineConfig (JSON), so that flags given on the leader's command line reach them too.
FOLLOWER_CONFIG_ENV = "PHALANX_TP_FOLLOWER_ENGINE_CONFIG"
# How long ranks wait for each other to form the group: the followers load the model first.
GROUP_FORM_TIMEOUT_S = 300.0
# How long a follower waits for the leader's next command: as good as forever (a day); the leader's death ends it sooner.
_IDLE_TIMEOUT = timedelta(days=1)


class TensorParallelError(EngineDeadError):
    """A rank of the group died, or a collective failed or timed out: the whole group is unusable."""

    reason = "TENSOR_PARALLEL_FAILED"


class Command(enum.IntEnum):
    STEP = 1  # run one forward pass (hidden states) on the batch in the payload
    GATHER = 2  # send the leader this rank's KV heads of the slots in the payload
    SCATTER = 3  # receive this rank's KV heads of the slots in the payload, and store them
    SHUTDOWN = 4  # exit 0


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port, for the leader's TCPStore to take over (no race for the port)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(128)
    return listener


class TpGroup:
    """This process's member of a tensor-parallel group; every method is a collective, called in the same order on all ranks."""

    def __init__(self, group, store: dist.Store, rank: int, size: int, timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timedelta(seconds=timeout_s)
        self._group = group
        self._store: dist.Store | None = store  # the group holds it too; kept so that its lifetime is plain

    @classmethod
    def join(
        cls, *, rank: int, size: int, port: int, timeout_s: float, form_timeout_s: float, listener: socket.socket | None = None
    ) -> TpGroup:
        """Forms the group (blocks until every rank joined); the leader passes the `listener` its store serves on."""
        try:
            listen: dict[str, Any] = {"master_listen_fd": listener.detach()} if listener else {}
            store = dist.TCPStore(
                "127.0.0.1", port, size, is_master=rank == LEADER, wait_for_workers=False, timeout=timedelta(seconds=form_timeout_s), **listen
            )
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, so torch's stubs omit it
            # Forming waits for the slowest rank's model load; every op after it passes its own timeout.
            options._timeout = timedelta(seconds=form_timeout_s)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            group = dist.ProcessGroupGloo(store, rank, size, options)
        except RuntimeError as exc:
            raise TensorParallelError(f"rank {rank} of {size} could not join the group: {exc}") from exc
        return cls(group, store, rank, size, timeout_s)

    # -- commands -------------------------------------------------------------------------
    def send_command(self, command: Command, sizes: tuple[int, ...] = (), payload: torch.Tensor | None = None) -> None:
        """Leader: a command's header, then its int64 payload (if any)."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = int(command)
        header[1] = payload.numel() if payload is not None else 0
        header[2 : 2 + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
        self._broadcast(header, self.timeout)
        if payload is not None and payload.numel():
            self._broadcast(payload.contiguous(), self.timeout)

    def receive_command(self) -> tuple[Command, list[int], torch.Tensor]:
        """Follower: waits (without a limit) for the leader's next command; returns it, its sizes and its payload."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._broadcast(header, _IDLE_TIMEOUT)
        values = header.tolist()
        payload = torch.empty(values[1], dtype=torch.int64)
        if values[1]:
            self._broadcast(payload, self.timeout)
        return Command(values[0]), values[2:], payload

    # -- collectives ----------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all), in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        options = AllgatherOptions()
        options.timeout = self.timeout
        self._wait("all_gather", lambda: self._group.allgather([parts], [tensor.contiguous()], options))
        return parts

    def gather_to_leader(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """The leader gets every rank's `tensor` in rank order; the others get None."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == LEADER else []
        options = GatherOptions()
        options.rootRank = LEADER
        options.timeout = self.timeout
        self._wait("gather", lambda: self._group.gather([parts] if parts else [], [tensor.contiguous()], options))
        return parts or None

    def scatter_from_leader(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> None:
        """Rank r receives parts[r] (given by the leader only) into `out`."""
        options = ScatterOptions()
        options.rootRank = LEADER
        options.timeout = self.timeout
        inputs = [[p.contiguous() for p in parts]] if parts is not None else []
        self._wait("scatter", lambda: self._group.scatter([out], inputs, options))

    def _broadcast(self, tensor: torch.Tensor, timeout: timedelta) -> None:
        options = BroadcastOptions()
        options.rootRank = LEADER
        options.rootTensor = 0
        options.timeout = timeout
        self._wait("broadcast", lambda: self._group.broadcast([tensor], options))

    def _wait(self, op: str, post) -> None:
        try:
            post().wait()
        except RuntimeError as exc:  # gloo reports a dead or hung peer as RuntimeError
            raise TensorParallelError(f"tensor-parallel {op} failed on rank {self.rank} of {self.size}: {exc}") from exc

    def close(self) -> None:
        """Drops the group: its sockets close, which fails any peer's pending op at once."""
        self._group = self._store = None


# -- the STEP payload ------------------------------------------------------------------------
@dataclass
class StepBatch:
    """What a follower needs to run the leader's step: the flat batch and PagedAttention's metadata."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    chunks: list[SeqChunk]
    invariant: bool

    def pack(self) -> tuple[tuple[int, ...], torch.Tensor]:
        """(header sizes, payload): tokens, positions, slots, then per chunk (offset, start, tokens, table length), then the tables."""
        meta = torch.tensor([[c.token_offset, c.start, c.num_tokens, len(c.block_table)] for c in self.chunks], dtype=torch.int64)
        tables = [c.block_table.to("cpu", torch.int64) for c in self.chunks]
        payload = torch.cat([
            self.token_ids.to("cpu", torch.int64), self.positions.to("cpu", torch.int64), self.slot_mapping.to("cpu", torch.int64),
            meta.flatten(), *tables,
        ])
        return (len(self.token_ids), len(self.chunks), int(self.invariant)), payload

    @classmethod
    def unpack(cls, sizes: list[int], payload: torch.Tensor, device: torch.device) -> StepBatch:
        tokens, num_chunks, invariant = sizes[0], sizes[1], bool(sizes[2])
        tables_at = 3 * tokens + 4 * num_chunks
        meta = payload[3 * tokens : tables_at].view(num_chunks, 4).tolist()
        chunks, offset = [], tables_at
        for token_offset, start, num_tokens, table_len in meta:
            chunks.append(SeqChunk(token_offset, start, num_tokens, payload[offset : offset + table_len].to(device)))
            offset += table_len
        token_ids, positions, slots = (payload[i * tokens : (i + 1) * tokens].to(device) for i in range(3))
        return cls(token_ids, positions, slots, chunks, invariant)
