"""A slot's weights in GPU memory that the memory service owns, mapped zero-copy by its engines over CUDA IPC.

On a GPU the shared segment (phalanx.failover.weights) is only the staging
copy: the memory service copies it once into one buffer on its device and
hands every engine an IPC descriptor of that buffer (JSON: the handle bytes
in base64). An engine opens it (cudaIpcOpenMemHandle under torch's
``rebuild_cuda_tensor``) and views each tensor at its layout offset, so a
standby holds no weights of its own and a takeover copies nothing. The
memory is valid while the service lives; an engine whose service dies
exits (MemoryServiceClient.broken), as on the CPU.

Why the service owns it and not engine 0: CUDA IPC memory dies with the
process that allocated it, and the primary is exactly the process whose
death the shadow must survive.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from phalanx.failover.weights import DATA_FILE, WeightLayout, WeightsError

__all__ = ["GpuSegment", "map_gpu_segment"]

# The IPC fields of torch's reduce_tensor for a CUDA tensor, in its order (torch/multiprocessing/reductions.py).
_FIELDS = (
    "tensor_cls", "size", "stride", "tensor_offset", "storage_cls", "dtype", "device", "handle", "storage_size_bytes",
    "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required",
)
_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


class GpuSegment:
    """A committed segment copied onto ``device``, kept for the service's life, with its IPC descriptor."""

    def __init__(self, directory: Path, layout: WeightLayout, device: str) -> None:
        target = torch.device(device)
        if target.type != "cuda":
            raise ValueError(f"GPU segments need a CUDA device, not {device!r}")
        host = torch.from_numpy(np.fromfile(directory / DATA_FILE, dtype=np.uint8))
        if host.numel() < layout.total_bytes:
            raise WeightsError(f"{directory / DATA_FILE} holds {host.numel()} bytes, the layout needs {layout.total_bytes}")
        self.buffer = host.to(target)
        torch.cuda.synchronize(target)
        self.layout_hash = layout.hash
        self.descriptor = _describe(self.buffer)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def _describe(buffer: torch.Tensor) -> dict[str, Any]:
    _, args = reduce_tensor(buffer)
    fields = dict(zip(_FIELDS, args, strict=True))
    return {
        "size": list(fields["size"]),
        "stride": list(fields["stride"]),
        "tensor_offset": int(fields["tensor_offset"]),
        "device": int(fields["device"]),
        "storage_size_bytes": int(fields["storage_size_bytes"]),
        "storage_offset_bytes": int(fields["storage_offset_bytes"]),
        "ref_counter_offset": int(fields["ref_counter_offset"]),
        "event_sync_required": bool(fields["event_sync_required"]),
        **{name: base64.b64encode(fields[name] or b"").decode() for name in _BYTES_FIELDS},
    }


def map_gpu_segment(descriptor: dict[str, Any], layout: WeightLayout) -> dict[str, torch.Tensor]:
    """The tensors of ``layout`` as views of the service's GPU buffer (no copy); WeightsError if it cannot be opened."""
    try:
        raw = {name: base64.b64decode(descriptor[name]) for name in _BYTES_FIELDS}
        buffer = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(descriptor["size"]), tuple(descriptor["stride"]), descriptor["tensor_offset"],
            torch.storage.TypedStorage, torch.uint8, descriptor["device"], raw["handle"], descriptor["storage_size_bytes"],
            descriptor["storage_offset_bytes"], False, raw["ref_counter_handle"], descriptor["ref_counter_offset"],
            raw["event_handle"] or None, descriptor["event_sync_required"],
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise WeightsError(f"cannot open the memory service's GPU weights: {error}") from error
    if buffer.numel() < layout.total_bytes:
        raise WeightsError(f"the GPU weights hold {buffer.numel()} bytes, the layout needs {layout.total_bytes}")
    tensors = {}
    for spec in layout.tensors:
        tensors[spec.name] = buffer[spec.offset : spec.offset + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)
    return tensors
