"""The model stack: MoE and dense decoders, paged KV cache, sampling, checkpoint loading."""

from phalanx.model.config import BUILTIN_MODELS, ModelConfig, builtin_config
from phalanx.model.loader import CheckpointError, load
from phalanx.model.tokenizer import ByteTokenizer, SpecialTokens
from phalanx.model.transformer import Transformer

__all__ = ["BUILTIN_MODELS", "ByteTokenizer", "CheckpointError", "ModelConfig", "SpecialTokens", "Transformer", "builtin_config", "load"]
