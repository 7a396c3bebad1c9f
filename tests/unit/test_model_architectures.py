"""Qwen2, Qwen3, Qwen3-MoE and Llama 3.x rope scaling from HF safetensors match transformers' own forward; other
architectures are refused by name."""

import json

import pytest
import torch

import phalanx.model
from phalanx.model.config import CheckpointError, ModelConfig

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")

from phalanx.testing.checkpoints import LLAMA3_ROPE, VOCAB, reference_logits, save_tiny_checkpoint  # noqa: E402 (needs transformers)

TOKENS = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(3)).tolist()
CASES = {
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3_attention_bias": ("qwen3", {"attention_bias": True}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [1]}),
    "qwen3_moe_norm_topk": ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe_sparse_step": ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2}),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama_linear_rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
}


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4
    assert expected.std().item() > 0.05  # the comparison is not between two near-constant tensors


@pytest.mark.parametrize("case", list(CASES))
def test_forward_logits_match_transformers(tmp_path, case):
    architecture, overrides = CASES[case]
    reference = save_tiny_checkpoint(tmp_path, architecture, **overrides)
    ours = phalanx.model.load(tmp_path)
    assert_matches(ours.forward_logits(TOKENS), reference_logits(reference, TOKENS))


def test_qwen3_moe_config_reads_dense_layers_normalisation_and_expert_size(tmp_path):
    save_tiny_checkpoint(tmp_path, "qwen3_moe", norm_topk_prob=False, mlp_only_layers=[1])
    config = ModelConfig.from_hf_dir(tmp_path)
    assert (config.num_experts, config.experts_per_token, config.expert_intermediate_size) == (4, 2, 48)
    assert config.dense_layers == (1,) and config.moe_layers == [0, 2] and not config.norm_topk_prob
    assert config.head_dim == 32 and config.qk_norm


def test_norm_topk_prob_changes_the_logits(tmp_path):
    # Both ways match transformers above; this guards against the two references being one and the same.
    plain = save_tiny_checkpoint(tmp_path / "plain", "qwen3_moe", norm_topk_prob=False)
    normalised = save_tiny_checkpoint(tmp_path / "norm", "qwen3_moe", norm_topk_prob=True)
    assert (reference_logits(plain, TOKENS) - reference_logits(normalised, TOKENS)).abs().max().item() > 1e-2


def test_llama3_rope_scaling_changes_the_logits(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama", rope_parameters=LLAMA3_ROPE)
    scaled = phalanx.model.load(tmp_path).forward_logits(TOKENS)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert (phalanx.model.load(tmp_path).forward_logits(TOKENS) - scaled).abs().max().item() > 1e-3


def _config_json(tmp_path, **fields):
    base = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "model_type": "llama",
    }
    (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
    return tmp_path


def test_an_unsupported_model_type_is_refused_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"model_type 'gpt2'.*GPT2LMHeadModel"):
        phalanx.model.load(_config_json(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_other_rope_types_are_refused_naming_them(tmp_path, rope_type):
    with pytest.raises(CheckpointError, match=f"rope scaling '{rope_type}'"):
        ModelConfig.from_hf_dir(_config_json(tmp_path, rope_scaling={"rope_type": rope_type, "factor": 2.0}))


def test_sliding_window_attention_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="sliding-window"):
        ModelConfig.from_hf_dir(_config_json(tmp_path, model_type="qwen2", use_sliding_window=True, sliding_window=16))
    # Disabled, the window is ignored (Qwen2.5's configs carry one).
    config = ModelConfig.from_hf_dir(_config_json(tmp_path, model_type="qwen2", use_sliding_window=False, sliding_window=16))
    assert config.attention_bias and not config.attention_out_bias


def test_engine_serves_a_qwen3_checkpoint_with_transformers_greedy_tokens(tmp_path):
    from phalanx.model.sampling import SamplingParams
    from phalanx.worker.config import EngineConfig
    from phalanx.worker.engine import Engine, EngineRequest

    reference = save_tiny_checkpoint(tmp_path, "qwen3")
    engine = Engine(phalanx.model.load(tmp_path), EngineConfig(num_kv_blocks=16, max_model_len=256))
    prompts = [TOKENS[:9], TOKENS[5:30]]
    ids = {engine.add_request(EngineRequest(p, SamplingParams(max_tokens=12, ignore_eos=True))).request_id: i for i, p in enumerate(prompts)}
    served: list[list[int]] = [[] for _ in prompts]
    while engine.has_work():
        for event in engine.step():
            served[ids[event.request_id]].append(event.token_id)
    for prompt, tokens in zip(prompts, served, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()
