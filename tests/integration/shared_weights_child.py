"""A read-only engine (ENGINE_ID>=1) for tests/integration/test_shared_weights.py.

Usage: ``shared_weights_child.py ROOT NAME TIMEOUT_S``. Builds phalanx-tiny-moe on
the meta device (no weights), maps the published segment, attaches it, runs a
forward pass, then loads the model normally and compares logits. Prints one
JSON line: timings, /proc/self/smaps_rollup at each step (kB) and whether the
outputs are bit-identical. ``write`` as a 4th argument instead writes into a
mapped tensor (the process must die of SIGSEGV: the pages are read-only).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from phalanx.failover.weights import WeightRole, attach_state_dict, layout_of, obtain_state_dict, role_for_engine
from phalanx.model import builtin_config, load
from phalanx.model.transformer import Transformer

PROMPT = list(b"The shadow engine wakes up and serves.")


def smaps() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return fields


def inside_segment(address: int, nbytes: int) -> bool:
    """Whether [address, address + nbytes) lies in a read-only mapping of the segment's weights.bin (zero copy)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5].endswith("/weights.bin"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address and address + nbytes <= end and parts[1].startswith("r-"):
                return True
    return False


def refuse_to_load() -> dict[str, torch.Tensor]:
    raise AssertionError("a read-only engine must never load weights")


def main(root: Path, name: str, timeout_s: float, action: str) -> None:
    torch.set_num_threads(1)
    config = builtin_config("phalanx-tiny-moe")
    with torch.device("meta"):
        shadow = Transformer(config)
    expected = layout_of(shadow.state_dict())
    role = role_for_engine(1)
    assert role is WeightRole.RO
    before = smaps()
    started = time.perf_counter()
    tensors = obtain_state_dict(role, expected, refuse_to_load, name=name, root=root, timeout_s=timeout_s)
    mapped_s = time.perf_counter() - started
    attach_state_dict(shadow, tensors)
    after_map = smaps()
    if action == "write":
        print("writing", flush=True)
        with torch.no_grad():
            next(iter(tensors.values())).fill_(1.0)
        print("wrote", flush=True)
        return
    started = time.perf_counter()
    touched = sum(float(t.sum()) for t in tensors.values())
    first_touch_s = time.perf_counter() - started
    after_touch = smaps()
    logits = shadow.forward_logits(PROMPT)
    normal = load("phalanx-tiny-moe")
    reference = normal.forward_logits(PROMPT)
    report = {
        "map_and_wait_s": mapped_s,
        "first_touch_s": first_touch_s,
        "touched": touched,
        "weight_bytes": expected.total_bytes,
        "smaps_before": before,
        "smaps_after_map": after_map,
        "smaps_after_touch": after_touch,
        "identical": bool(torch.equal(logits, reference)),
        "greedy": logits.argmax(-1).tolist(),
        "parameters_in_segment": all(inside_segment(p.data_ptr(), p.nbytes) for p in shadow.parameters()),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "run")
