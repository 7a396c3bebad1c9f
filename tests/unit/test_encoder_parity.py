"""Our CLIP vision tower and Whisper encoder on HF checkpoints match transformers' own implementations."""

import numpy as np
import pytest
import torch

from phalanx.encoder_pool.audio import load_whisper_encoder
from phalanx.encoder_pool.mel import log_mel_chunks
from phalanx.encoder_pool.models import load_audio_encoder, load_image_encoder
from phalanx.encoder_pool.vision import load_clip_vision

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")


def _scale_up(model, factor):
    # Default init gives tiny activations; scaling makes a max-abs-diff bound mean something.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "embed_positions" not in name:
                p.mul_(factor)


def _save_clip_vision(path):
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8,
    )
    model = transformers.CLIPVisionModel(config).eval()
    _scale_up(model, 4.0)
    model.save_pretrained(path)
    return model


def test_clip_vision_matches_transformers_on_saved_checkpoint(tmp_path):
    reference = _save_clip_vision(tmp_path)
    ours = load_clip_vision(tmp_path, feature_layer=-2)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(pixel_values=pixels, output_hidden_states=True)
        got = ours(pixels)
    assert (got.last_hidden_state - expected.last_hidden_state).abs().max().item() < 1e-4
    assert (got.pooler_output - expected.pooler_output).abs().max().item() < 1e-4
    # The projector's input: the penultimate layer's patch tokens (hidden_states[0] is the embeddings).
    assert (got.features - expected.hidden_states[-2][:, 1:]).abs().max().item() < 1e-4
    assert expected.last_hidden_state.std().item() > 0.05


def test_whisper_encoder_matches_transformers_on_saved_checkpoint(tmp_path):
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        num_mel_bins=80, d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, max_source_positions=50, vocab_size=100,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )
    reference = transformers.WhisperForConditionalGeneration(config).eval()
    _scale_up(reference, 2.0)
    reference.save_pretrained(tmp_path)  # keys under model.encoder.: the loader picks them out
    ours = load_whisper_encoder(tmp_path)
    features = torch.randn(2, 80, 100, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference.model.encoder(features).last_hidden_state
        got = ours(features)
    assert got.shape == expected.shape == (2, 50, 64)
    assert (got - expected).abs().max().item() < 1e-4
    assert expected.std().item() > 0.05


def test_whisper_encoder_takes_audio_shorter_than_its_window(tmp_path):
    encoder = load_audio_encoder("tiny-whisper", 32)
    short = encoder.encode(torch.randn(1, 80, 200))
    assert short.shape == (1, encoder.tokens_for_frames(200), 32) == (1, 25, 32)
    with pytest.raises(ValueError, match="exceed"):
        encoder.encoder(torch.randn(1, 80, 3002))


def test_builtin_encoders_are_seeded_identically_in_every_build():
    a, b = load_image_encoder("tiny-clip", 48), load_image_encoder("tiny-clip", 48)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    first, second = a.encode(pixels), b.encode(pixels)
    assert first.shape == (2, a.tokens_per_image, 48) == (2, 16, 48)
    assert torch.equal(first, second)
    assert first.std().item() > 0
    # Different images give different embeddings (the weights are not degenerate).
    assert not torch.allclose(first[0], first[1])
    other_seed = load_image_encoder("tiny-clip", 48, seed=7).encode(pixels)
    assert not torch.allclose(first, other_seed)


def test_clip_image_preprocessing_matches_transformers_without_resampling():
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    encoder = load_image_encoder("tiny-clip", 16)
    # The shortest edge is already 32: only the crop, scale and normalisation apply, which must match exactly.
    rgb = np.random.default_rng(0).integers(0, 256, (32, 57, 3), dtype=np.uint8)
    expected = processor(images=rgb, return_tensors="np")["pixel_values"][0]
    got = encoder.preprocess(rgb).numpy()
    assert got.shape == expected.shape == (3, 32, 32)
    assert np.abs(got - expected).max() < 1e-5


@pytest.mark.parametrize("shape", [(96, 128), (150, 90), (20, 24)], ids=["down", "down-portrait", "up"])
def test_clip_image_preprocessing_with_resampling_stays_close_to_transformers(shape):
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    encoder = load_image_encoder("tiny-clip", 16)
    # A smooth picture: bicubic kernels (PIL's antialiased, OpenCV's) differ only at sharp edges.
    y, x = np.mgrid[0 : shape[0], 0 : shape[1]]
    rgb = np.stack([x * 255 // shape[1], y * 255 // shape[0], (x + y) * 127 // sum(shape)], axis=-1).astype(np.uint8)
    expected = processor(images=rgb, return_tensors="np")["pixel_values"][0]
    got = encoder.preprocess(rgb).numpy()
    assert got.shape == expected.shape
    # Normalised units (1/255/std ≈ 0.015 per grey level): within a few grey levels everywhere.
    assert np.abs(got - expected).mean() < 0.03
    assert np.abs(got - expected).max() < 0.2


def test_log_mel_features_match_whisper_feature_extractor():
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    rng = np.random.default_rng(3)
    t = np.arange(16_000 * 7) / 16_000
    audio = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    expected = extractor(audio, sampling_rate=16_000, return_tensors="np")["input_features"]
    got = log_mel_chunks(audio).numpy()
    assert got.shape == expected.shape == (1, 80, 3000)
    assert np.abs(got - expected).max() < 1e-4


def test_log_mel_features_split_long_audio_into_padded_30_second_chunks():
    audio = np.random.default_rng(4).standard_normal(16_000 * 45).astype(np.float32) * 0.1
    chunks = log_mel_chunks(audio)
    assert chunks.shape == (2, 80, 3000)
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    second = extractor(audio[16_000 * 30 :], sampling_rate=16_000, return_tensors="np")["input_features"][0]
    assert np.abs(chunks[1].numpy() - second).max() < 1e-4
