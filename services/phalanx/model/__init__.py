"""The model stack: MoE and dense decoders, paged KV cache, sampling, checkpoint loading.

Names resolve lazily so that processes which only tokenize (the router) can
use `phalanx.model.tokenizer` and `phalanx.model.config` without importing torch.
"""

from importlib import import_module

_EXPORTS = {
    "BUILTIN_MODELS": "phalanx.model.config",
    "ModelConfig": "phalanx.model.config",
    "builtin_config": "phalanx.model.config",
    "BUILTIN_CHECKPOINTS": "phalanx.model.config",
    "CheckpointError": "phalanx.model.config",
    "DEFAULT_MODEL": "phalanx.model.config",
    "load": "phalanx.model.loader",
    "ByteTokenizer": "phalanx.model.tokenizer",
    "SpecialTokens": "phalanx.model.tokenizer",
    "Transformer": "phalanx.model.transformer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'phalanx.model' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
