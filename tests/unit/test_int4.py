"""4-bit packed linear weights (phalanx.model.int4): the file's own codes, kernel results, batch invariance, the
accuracy bound of the served paths against float32, and which engines pack."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

import phalanx.model
from phalanx.model.config import gguf_file
from phalanx.model.int4 import GROUP, Int4Codes, Int4Linear, Int4Weight, gguf_codes, pack_linears, quantize
from phalanx.model.sampling import SamplingParams
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest

pytestmark = pytest.mark.unit

# Prompts the accuracy bound is stated on (README.md, "Weights and dtypes").
STANDARD_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_codes_of_q4_0_and_q4_1_blocks_are_the_files_weights_exactly(ggml_type):
    weights = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    data = gguf_quantize(weights, ggml_type)
    codes = gguf_codes(data, int(ggml_type), weights.shape)
    assert np.array_equal(codes.dequantized(), gguf_dequantize(data, ggml_type))


def test_codes_of_q4_k_super_blocks_are_the_files_weights_exactly():
    # The gguf package cannot quantize to Q4_K; random blocks (fp16 d and dmin, 6-bit scales and mins, codes) are
    # as good a test of the unpacking as real ones.
    rng = np.random.default_rng(1)
    rows, supers = 32, 2
    d = rng.uniform(0.001, 0.01, (rows, supers, 1)).astype(np.float16).view(np.uint8)
    dmin = rng.uniform(0.001, 0.01, (rows, supers, 1)).astype(np.float16).view(np.uint8)
    scales = rng.integers(0, 256, (rows, supers, 12), dtype=np.uint8)
    quants = rng.integers(0, 256, (rows, supers, 128), dtype=np.uint8)
    data = np.concatenate([d, dmin, scales, quants], axis=-1).reshape(rows, supers * 144)
    codes = gguf_codes(data, int(GGMLQuantizationType.Q4_K), (rows, supers * 256))
    assert np.array_equal(codes.dequantized(), gguf_dequantize(data, GGMLQuantizationType.Q4_K))


def test_codes_of_the_packaged_checkpoint_are_its_weights_exactly():
    reader = gguf.GGUFReader(gguf_file("smollm2-135m-instruct"))
    tensors = [t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q4_1][:7]
    assert len(tensors) == 7
    for tensor in tensors:
        codes = gguf_codes(tensor.data, int(tensor.tensor_type), (int(tensor.shape[-1]), int(tensor.shape[0])))
        assert np.array_equal(codes.dequantized(), gguf_dequantize(tensor.data, tensor.tensor_type)), tensor.name


def test_the_kernel_multiplies_by_the_codes_weights():
    codes = quantize(torch.randn(96, 128, generator=torch.Generator().manual_seed(2)))
    weight = Int4Weight.from_codes(codes)
    dense = torch.from_numpy(codes.dequantized())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(weight.matmul(x), x @ dense.T, atol=1e-4)  # float32 activations: the codes, exactly
    bf16 = weight.to(torch.bfloat16)
    assert bf16.dtype is torch.bfloat16 and bf16.packed.dtype is torch.uint8
    expected = x @ dense.T
    assert (bf16.matmul(x.bfloat16()).float() - expected).abs().max() < 0.02 * expected.abs().max()  # bfloat16 rounding


def test_each_rows_result_depends_on_that_row_alone_whatever_the_rows():
    weight = Int4Weight.from_codes(quantize(torch.randn(64, 256, generator=torch.Generator().manual_seed(4)))).to(torch.bfloat16)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    full = weight.matmul(x)
    for rows in range(1, 40):
        assert torch.equal(weight.matmul(x[:rows]), full[:rows]), f"{rows} rows"


def test_quantize_rounds_to_the_nearest_of_16_levels_per_group():
    weight = torch.randn(16, 2 * GROUP, generator=torch.Generator().manual_seed(6))
    codes = quantize(weight)
    step = codes.scale.max()
    assert codes.codes.max() <= 15 and np.abs(codes.dequantized() - weight.numpy()).max() <= step / 2 + 1e-6


def test_packing_needs_a_linear_of_the_codes_shape():
    model = phalanx.model.load("phalanx-tiny-dense")
    wrong = Int4Weight.from_codes(Int4Codes(np.zeros((16, 64), np.uint8), np.ones((16, 2), np.float32), np.zeros((16, 2), np.float32)))
    with pytest.raises(ValueError, match="no nn.Linear of shape"):
        pack_linears(model, {"layers.0.self_attn.q_proj.weight": wrong})


def _packed_tiny(name: str = "phalanx-tiny-dense"):
    """A built-in model with every projection packed by round-to-nearest, in bfloat16: the served int4 path on a model
    that loads at once."""
    model = phalanx.model.load(name)
    weights = {n: Int4Weight.from_codes(quantize(p)) for n, p in model.named_parameters() if n.endswith("_proj.weight")}
    pack_linears(model, weights)
    return model.to(torch.bfloat16)


def _run(engine, prompts, max_tokens):
    seqs = [engine.add_request(EngineRequest(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=str(i)))
            for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return [list(s.output_ids) for s in seqs]


def test_deterministic_mode_on_packed_bfloat16_weights_gives_the_same_tokens_at_any_batch_size():
    model = _packed_tiny()
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    prompts = [model.tokenizer.encode(f"request {i}: " + "tell me about the sea " * (1 + i % 4)) for i in range(12)]
    config = EngineConfig(deterministic=True, num_kv_blocks=256)
    batched = _run(Engine(model, config), prompts, 16)
    for i in (0, 3, 7, 11):
        assert batched[i] == _run(Engine(model, config), [prompts[i]], 16)[0], f"request {i} changed with batching"
    chunked = _run(Engine(model, config.model_copy(update={"max_batched_tokens": 16})), [prompts[3]], 16)[0]
    assert chunked == batched[3]


@pytest.fixture(scope="module")
def served_variants():
    name = "smollm2-135m-instruct"
    return {
        "float32": phalanx.model.load(name),
        "bfloat16": phalanx.model.load(name, dtype=torch.bfloat16),
        "bfloat16+int4": phalanx.model.load(name, dtype=torch.bfloat16, keep_int4=True),
        # What a worker serves by default where oneDNN multiplies bfloat16: whole prompts go by the prepacked copies.
        "bfloat16+int4+copies": phalanx.model.load(name, dtype=torch.bfloat16, keep_int4=True, dense_copy=True),
    }


@pytest.mark.slow
def test_the_packaged_checkpoint_loads_its_4_bit_weights_packed(served_variants):
    packed = served_variants["bfloat16+int4"]
    projections = [m for m in packed.modules() if isinstance(m, Int4Linear)]
    assert len(projections) == 7 * packed.config.num_layers
    assert packed.embed_tokens.weight.dtype is torch.bfloat16  # the Q8_0 embedding comes dense


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bfloat16", "bfloat16+int4", "bfloat16+int4+copies"])
def test_served_paths_stay_within_the_stated_accuracy_bound_of_float32(served_variants, variant):
    # The bound README.md states, on float32's own 24-token greedy continuation of each standard prompt (teacher
    # forcing, so that one early flip does not decide the rest): logits within 2.5 of float32's (they span about 60),
    # the same top token at >= 90 % of positions, and a different one only where float32's top two are a near tie.
    reference, model = served_variants["float32"], served_variants[variant]
    agreed = positions = 0
    for text in STANDARD_PROMPTS:
        tokens = reference.tokenizer.encode(text, add_bos=True)
        start = len(tokens) - 1
        for _ in range(24):
            tokens.append(int(reference.forward_logits(tokens)[-1].argmax()))
        expected, got = reference.forward_logits(tokens)[start:], model.forward_logits(tokens)[start:]
        assert (got - expected).abs().max().item() < 2.5, text
        same = got.argmax(-1) == expected.argmax(-1)
        top2 = expected.topk(2, dim=-1).values
        assert ((top2[:, 0] - top2[:, 1])[~same] < 5.0).all(), f"{text!r}: a clear float32 choice changed"
        agreed, positions = agreed + int(same.sum()), positions + len(same)
    assert agreed / positions >= 0.9


@pytest.mark.slow
def test_a_warm_load_reads_the_packed_cache_and_a_broken_one_is_rebuilt(tmp_path):
    name = "smollm2-135m-instruct"
    first = phalanx.model.load(name, dtype=torch.bfloat16, keep_int4=True, cache_root=tmp_path)
    (cached,) = (tmp_path / "gguf").glob("*.int4-*.safetensors")
    warm = phalanx.model.load(name, dtype=torch.bfloat16, keep_int4=True, cache_root=tmp_path)
    prompt = first.tokenizer.encode("The capital of France is", add_bos=True)
    assert torch.equal(first.forward_logits(prompt), warm.forward_logits(prompt))
    cached.write_bytes(b"not a safetensors file")
    rebuilt = phalanx.model.load(name, dtype=torch.bfloat16, keep_int4=True, cache_root=tmp_path)
    assert torch.equal(rebuilt.forward_logits(prompt), first.forward_logits(prompt))


def test_packed_weights_run_on_a_cpu_only():
    with pytest.raises(ValueError, match="CPU only"):
        phalanx.model.load("phalanx-tiny-dense", device="meta", keep_int4=True)


def test_the_engine_config_picks_bfloat16_where_the_cpu_has_it_and_packs_only_a_whole_model_in_one_process(monkeypatch):
    import phalanx.model.ops as ops

    monkeypatch.delenv("PHALANX_ENGINE_DTYPE", raising=False)  # the suite pins float32 (tests/conftest.py); `auto` here
    monkeypatch.setattr(ops, "cpu_has_native_bfloat16", lambda: True)
    assert EngineConfig().torch_dtype() is torch.bfloat16 and EngineConfig().keeps_int4()
    assert EngineConfig(dtype="float32").torch_dtype() is torch.float32 and not EngineConfig(dtype="float32").keeps_int4()
    assert not EngineConfig(weights="dense").keeps_int4()
    assert not EngineConfig(tensor_parallel_size=2).keeps_int4()
    monkeypatch.setattr(ops, "cpu_has_native_bfloat16", lambda: False)
    assert EngineConfig().torch_dtype() is torch.float32 and not EngineConfig().keeps_int4()
    monkeypatch.setenv("PHALANX_ENGINE_DTYPE", "bfloat16")
    assert EngineConfig().torch_dtype() is torch.bfloat16
