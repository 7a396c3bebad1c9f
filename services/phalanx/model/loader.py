"""Builds models: built-in ones from a seed, GGUF files (phalanx.model.gguf_weights), or Hugging Face checkpoints (Llama, Mistral,
Mixtral, Qwen2, Qwen3, Qwen3-MoE) from safetensors."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from phalanx.model import onednn
from phalanx.model.config import BUILTIN_CHECKPOINTS, BUILTIN_MODELS, CheckpointError, ModelConfig, builtin_config, gguf_file, known_models
from phalanx.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from phalanx.model.transformer import Transformer, initialise

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Per-expert tensors: Mixtral's w1 (gate) / w3 (up) / w2 (down), Qwen3-MoE's gate_proj / up_proj / down_proj.
_HF_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_RENAMES = {
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "self_attn.q_norm.weight": "self_attn.q_norm",
    "self_attn.k_norm.weight": "self_attn.k_norm",
    "block_sparse_moe.gate.weight": "mlp.gate.weight",
    # transformers >= 5 fused layout
    "mlp.experts.gate_up_proj": "mlp.w13",
    "mlp.experts.down_proj": "mlp.w2",
}


def load(
    name_or_path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    cache_root: Path | None = None,
    keep_int4: bool = False,
    dense_copy: bool = False,
) -> Transformer:
    """Loads a built-in model by name, a GGUF file (or a directory holding one) or an HF-layout checkpoint directory.

    The returned model is in eval mode and carries its tokenizer as
    `.tokenizer` and its `model_version` as `.version`. A GGUF's dequantized
    weights are cached under ``cache_root`` (default: $PHALANX_CACHE_DIR or
    ~/.cache/phalanx). ``keep_int4`` keeps a GGUF's 4-bit linear weights as codes for torch's int4 CPU kernel
    (phalanx.model.int4; fast with bfloat16 on a CPU only); other sources ignore it. ``dense_copy`` (with ``keep_int4``,
    where oneDNN multiplies bfloat16 in hardware) adds each 4-bit weight's bfloat16 copy prepacked for oneDNN, which
    steps of several rows multiply by, and prepacks the LM head (phalanx.model.onednn).
    """
    if keep_int4 and torch.device(device).type != "cpu":
        raise ValueError(f"4-bit packed weights run on a CPU only, not on {device}")
    if str(name_or_path) in BUILTIN_MODELS:
        config = builtin_config(str(name_or_path), **({"seed": seed} if seed is not None else {}))
        model = Transformer(config)
        initialise(model, config.seed)
        tokenizer: Tokenizer = ByteTokenizer()
        version = model_version(name_or_path, config)
    elif (gguf := gguf_file(name_or_path)) is not None:
        from phalanx.model.gguf_weights import load_gguf

        name = str(name_or_path) if str(name_or_path) in BUILTIN_CHECKPOINTS else gguf.stem
        model, tokenizer, version = load_gguf(gguf, name=name, cache_root=cache_root, keep_int4=keep_int4, dense_copy=dense_copy)
    else:
        path = Path(name_or_path)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} is not a built-in model ({known_models()}), a .gguf file or a directory with config.json")
        config = ModelConfig.from_hf_dir(path)
        with torch.device("meta"):
            model = Transformer(config)
        model = model.to_empty(device="cpu")
        load_hf_weights(model, path)
        tokenizer = load_tokenizer(path, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
        version = model_version(name_or_path, config)
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    if keep_int4 and dense_copy and dtype == torch.bfloat16 and onednn.available():
        model.lm_head_packed = onednn.pack(model.lm_head_weight())
    model.tokenizer = tokenizer
    model.version = version
    return model


def skeleton(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32, seed: int | None = None) -> Transformer:
    """The model ``load`` would give, on the meta device (no weights), with its tokenizer and ``version``.

    A failover engine attaches shared weights to it (phalanx.failover.weights) instead of loading them.
    """
    if str(name_or_path) in BUILTIN_MODELS:
        config = builtin_config(str(name_or_path), **({"seed": seed} if seed is not None else {}))
        tokenizer: Tokenizer = ByteTokenizer()
        version = model_version(name_or_path, config)
    elif (gguf := gguf_file(name_or_path)) is not None:
        from phalanx.model.gguf_weights import gguf_skeleton

        name = str(name_or_path) if str(name_or_path) in BUILTIN_CHECKPOINTS else gguf.stem
        config, tokenizer, version = gguf_skeleton(gguf, name=name)
    elif (Path(name_or_path) / "config.json").is_file():
        path = Path(name_or_path)
        config = ModelConfig.from_hf_dir(path)
        tokenizer = load_tokenizer(path, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
        version = model_version(name_or_path, config)
    else:
        raise CheckpointError(f"{name_or_path} is not a built-in model ({known_models()}), a .gguf file or a directory with config.json")
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype=dtype).eval()
    model.requires_grad_(False)
    model.tokenizer = tokenizer
    model.version = version
    return model


def model_version(name_or_path: str | Path, config: ModelConfig) -> str:
    """What the weights are: ``<name>@seed=<seed>`` (built-in) or ``<name>@<12 hex digits>`` (checkpoint).

    A checkpoint's digest covers the names, sizes and mtimes of its config and
    weight files: cheap to compute, and it changes whenever a file is replaced.
    """
    if str(name_or_path) in BUILTIN_MODELS:
        return f"{config.name}@seed={config.seed}"
    path = Path(name_or_path)
    files = {p.relative_to(path).as_posix(): p for pattern in ("config.json", "*.safetensors", "*.bin") for p in path.glob(pattern)}
    digest = hashlib.sha256()
    for relative, file in sorted(files.items()):
        stat = file.stat()
        digest.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"{config.name}@{digest.hexdigest()[:12]}"


def load_hf_weights(model: Transformer, path: Path) -> None:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    target, expert, part = _map_name(hf_name)
                    if target is None:
                        continue
                    if target not in params:
                        raise CheckpointError(f"{file.name}: {hf_name} has no place in {model.config.name}")
                    _copy(params[target], f.get_tensor(hf_name), hf_name, expert, part, model.config.expert_intermediate_size)
                    loaded.add(target if expert is None else f"{target}[{expert}].{part}")
    _check_complete(model, params, loaded)


def _map_name(hf_name: str) -> tuple[str | None, int | None, str | None]:
    """HF parameter name -> (our parameter, expert index, w1/w2/w3 part)."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None, None, None
    if not hf_name.startswith("model.layers."):
        return {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm", "lm_head.weight": "lm_head.weight"}.get(
            hf_name, hf_name
        ), None, None
    matched = _LAYER.match(hf_name)
    assert matched is not None  # every "model.layers." name matches
    layer, rest = matched.groups()
    if m := _HF_EXPERT.match(rest):
        expert, part = int(m.group(1)), _EXPERT_PARTS.get(m.group(2), m.group(2))
        return f"layers.{layer}.mlp.{'w2' if part == 'w2' else 'w13'}", expert, part
    return f"layers.{layer}.{_RENAMES.get(rest, rest)}", None, None


def _copy(param: torch.Tensor, tensor: torch.Tensor, hf_name: str, expert: int | None, part: str | None, inter: int) -> None:
    dest = param
    if expert is not None:
        dest = param[expert]
        if part == "w1":
            dest = dest[:inter]
        elif part == "w3":
            dest = dest[inter:]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{hf_name}: shape {tuple(tensor.shape)} does not match {tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))


def _check_complete(model: Transformer, params: Mapping[str, torch.Tensor], loaded: set[str]) -> None:
    missing = []
    for name, param in params.items():
        if name.endswith(("mlp.w13", "mlp.w2")):
            parts = ("w1", "w3") if name.endswith("w13") else ("w2",)
            fused_loaded = name in loaded
            for e in range(param.shape[0]):
                if not fused_loaded and any(f"{name}[{e}].{p}" not in loaded for p in parts):
                    missing.append(f"{name}[{e}]")
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")
