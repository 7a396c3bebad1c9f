"""Our forward on HF Mixtral/Llama checkpoints matches transformers' own implementation."""

import pytest
import torch

import phalanx.model

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")


def _save_mixtral(path, *, seed=0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0,
    )
    model = transformers.MixtralForCausalLM(config).eval()
    # Default init gives near-uniform logits; scale up so the comparison is meaningful.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    model.save_pretrained(path)
    return model


def _save_llama(path):
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("saver", [_save_mixtral, _save_llama], ids=["mixtral", "llama"])
def test_forward_logits_match_transformers_on_saved_checkpoint(tmp_path, saver):
    reference = saver(tmp_path)
    ours = phalanx.model.load(tmp_path)
    tokens = torch.randint(0, 300, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0].float()
    got = ours.forward_logits(tokens)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4
    assert expected.std().item() > 0.05  # the comparison is not between two near-constant tensors


def test_checkpoint_missing_an_expert_is_rejected(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_mixtral(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(phalanx.model.CheckpointError, match="lacks"):
        phalanx.model.load(tmp_path)


def test_builtin_models_are_deterministic_across_loads():
    a = phalanx.model.load("phalanx-tiny-moe")
    b = phalanx.model.load("phalanx-tiny-moe")
    tokens = a.tokenizer.encode("the same seed, the same bytes")
    assert torch.equal(a.forward_logits(tokens), b.forward_logits(tokens))
    c = phalanx.model.load("phalanx-tiny-moe", seed=1)
    assert not torch.equal(a.forward_logits(tokens), c.forward_logits(tokens))
