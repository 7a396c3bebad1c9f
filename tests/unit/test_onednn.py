"""bfloat16 weights prepacked for oneDNN (phalanx.model.onednn): the same products as F.linear, each row's alone, and
4-bit weights that multiply by their prepacked copy from DENSE_FROM_ROWS rows, never in batch-invariant mode."""

import pytest
import torch
import torch.nn.functional as F

import phalanx.model
from phalanx.model import onednn
from phalanx.model.int4 import Int4Linear, Int4Weight, pack_linears, quantize
from phalanx.model.ops import linear
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not onednn.available(), reason="this CPU does not multiply bfloat16 in hardware: nothing is prepacked"),
]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_a_prepacked_product_is_f_linears_bit_for_bit_and_each_rows_alone():
    weight = (_randn(1536, 576, seed=1) * 0.02).bfloat16()
    packed = onednn.pack(weight)
    x = _randn(40, 576, seed=2).bfloat16()
    full = onednn.matmul(x, packed)
    assert torch.equal(full, F.linear(x, weight))
    for rows in (1, 2, 3, 4, 5, 16, 17, 39):
        assert torch.equal(onednn.matmul(x[:rows], packed), full[:rows]), f"{rows} rows"
    assert torch.equal(linear(x[:3], packed, invariant=True), full[:3])  # the invariant padding takes it as it is


def test_a_4_bit_weight_uses_its_dense_copy_from_dense_from_rows_and_never_when_batch_invariant():
    codes = quantize(_randn(96, 128, seed=3))
    weight = Int4Weight.from_codes(codes).to(torch.bfloat16)
    dense = torch.from_numpy(codes.dequantized()).bfloat16()
    weight.dense = onednn.pack(dense)
    x = _randn(8, 128, seed=4).bfloat16()
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
    by_codes = kernel(x, weight.packed, 32, weight.scales_and_zeros)
    few = onednn.DENSE_FROM_ROWS - 1
    assert torch.equal(weight.matmul(x[:few]), by_codes[:few])
    assert torch.equal(weight.matmul(x[: few + 1]), F.linear(x[: few + 1], dense))
    assert torch.equal(weight.matmul(x, invariant=True), by_codes)
    assert not torch.equal(by_codes, F.linear(x, dense))  # the two round differently: the test above can tell them apart


def _packed_tiny_with_dense_copies():
    model = phalanx.model.load("phalanx-tiny-dense")
    dense = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("_proj.weight")}
    weights = {n: Int4Weight.from_codes(quantize(p)) for n, p in dense.items()}
    for name, weight in weights.items():
        weight.dense = onednn.pack(torch.from_numpy(quantize(dense[name]).dequantized()))
    pack_linears(model, weights)
    model = model.to(torch.bfloat16)
    model.lm_head_packed = onednn.pack(model.lm_head_weight())
    return model


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    seqs = [engine.add_request(EngineRequest(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=str(i)))
            for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return [list(s.output_ids) for s in seqs]


def test_deterministic_mode_with_dense_copies_gives_the_same_tokens_at_any_batch_size():
    model = _packed_tiny_with_dense_copies()
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear) and model.layers[0].mlp.down_proj.weight.dense is not None
    prompts = [model.tokenizer.encode(f"request {i}: " + "tell me about the sea " * (1 + i % 4)) for i in range(12)]
    config = EngineConfig(deterministic=True, num_kv_blocks=256)
    batched = _run(Engine(model, config), prompts, 16)
    for i in (0, 5, 11):
        assert batched[i] == _run(Engine(model, config), [prompts[i]], 16)[0], f"request {i} changed with batching"


def test_the_engine_config_adds_dense_copies_with_auto_weights_only(monkeypatch):
    monkeypatch.delenv("PHALANX_ENGINE_DTYPE", raising=False)  # the suite pins float32 (tests/conftest.py)
    name = "smollm2-135m-instruct"
    auto = EngineConfig(model=name).load_model()
    assert auto.lm_head_packed is not None and auto.layers[0].self_attn.q_proj.weight.dense is not None
    codes_only = EngineConfig(model=name, weights="int4").load_model()
    assert codes_only.lm_head_packed is None and codes_only.layers[0].self_attn.q_proj.weight.dense is None
    assert isinstance(codes_only.layers[0].self_attn.q_proj, Int4Linear)
    prompt = auto.tokenizer.encode("The capital of France is", add_bos=True)
    # Whole prompts multiply by the copies (many rows), the codes' path by the codes: near, not equal.
    assert (auto.forward_logits(prompt) - codes_only.forward_logits(prompt)).abs().max() < 2.5
