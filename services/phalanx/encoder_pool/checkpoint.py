"""Reading a Hugging Face model directory: config.json and its safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

__all__ = ["read_hf_config", "read_safetensors_dir"]


def read_hf_config(root: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((root / "config.json").read_text())
    return config


def read_safetensors_dir(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` shard in `root`."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state
