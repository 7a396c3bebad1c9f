"""Tensor channels: ordered point-to-point tensor transfer between two processes.

Each process runs one ``ChannelEndpoint`` (endpoint.py). It hosts a torch
``TCPStore`` as its rendezvous point and advertises that store in etcd under
a lease (rendezvous.py). A channel is a standalone 2-rank process group for
one pair and one ``channel_id`` alone (process_group.py): the opener (rank 0)
joins the acceptor's (rank 1) store under ``ch/<channel_id>/``. Groups form
in a few ms, so channels are cheap, and a dead pair never poisons the others.

Failure model: every operation has a timeout. A failed or timed-out op
marks its channel broken and raises ``ChannelError`` (channel.py); the
caller opens a new channel (to the same or another peer) and retries. A
SIGKILLed peer fails a pending op within tens of ms (gloo sees the socket
close); a hung peer fails it at the timeout.

The gRPC fallback (grpc_stream.py) carries the same tensors over
``TensorStream.Push`` for pairs where a process group cannot form; it is
also the baseline the channels are measured against
(``phalanx.bench.channel``).

Blocking torch calls run on daemon threads, never on the event loop
(threads.py). Batch small tensors: each op costs a thread hop.
"""

from phalanx.common.channels.channel import ChannelError, ChannelNotKeptError, TensorChannel
from phalanx.common.channels.endpoint import ChannelEndpoint
from phalanx.common.channels.grpc_stream import CHUNK_BYTES, TensorStreamServicer
from phalanx.common.channels.rendezvous import channel_key

__all__ = [
    "CHUNK_BYTES",
    "ChannelEndpoint",
    "ChannelError",
    "ChannelNotKeptError",
    "TensorChannel",
    "TensorStreamServicer",
    "channel_key",
]
