"""Whisper's log-mel features in torch (16 kHz, 80 mel bins, 25 ms window, 10 ms hop, 30 s chunks padded), and WAV decoding.

The same computation as ``transformers.WhisperFeatureExtractor``: a periodic
Hann window of 400 samples, centred reflect-padded STFT with hop 160, power
spectrum, Slaney-normalised mel filters up to 8 kHz, log10 clamped at 1e-10,
floored at max - 8, then (x + 4) / 4; the last STFT frame is dropped, so a
30 s chunk gives 3,000 frames.
"""

from __future__ import annotations

import io
import wave
from functools import lru_cache

import numpy as np
import torch

from phalanx.encoder_pool.errors import MediaError

__all__ = ["CHUNK_SAMPLES", "HOP", "N_FFT", "SAMPLE_RATE", "decode_wav", "log_mel_chunks", "mel_filters"]

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
CHUNK_SECONDS = 30
CHUNK_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear below 1 kHz, logarithmic above."""
    mel = 3.0 * hz / 200.0
    log_region = hz >= 1000.0
    return np.where(log_region, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), mel)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    log_region = mel >= 15.0
    return np.where(log_region, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), hz)


@lru_cache(maxsize=8)
def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """(n_fft // 2 + 1, n_mels) triangular filters, Slaney area normalisation, 0 Hz to 8 kHz."""
    fft_freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    mel_points = np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(8000.0)), n_mels + 2)
    filter_freqs = _mel_to_hz(mel_points)
    widths = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    filters *= 2.0 / (filter_freqs[2 : n_mels + 2] - filter_freqs[:n_mels])
    return filters


def log_mel_chunks(waveform: np.ndarray, *, n_mels: int = 80, pad: bool = True) -> torch.Tensor:
    """16 kHz mono float audio -> (chunks, n_mels, 3000) features, one chunk per started 30 s, zero-padded.

    ``pad=False`` computes one unpadded chunk (at most 30 s): fewer frames,
    cheaper to encode, but not what a Whisper checkpoint was trained on.
    """
    audio = torch.as_tensor(np.asarray(waveform, dtype=np.float32))
    if audio.ndim != 1:
        raise ValueError(f"expected mono audio, got shape {tuple(audio.shape)}")
    if pad:
        chunks = max(1, -(-audio.numel() // CHUNK_SAMPLES))
        audio = torch.nn.functional.pad(audio, (0, chunks * CHUNK_SAMPLES - audio.numel())).view(chunks, CHUNK_SAMPLES)
    else:
        if audio.numel() > CHUNK_SAMPLES:
            raise ValueError("unpadded features take at most one 30 s chunk")
        audio = audio.view(1, -1)
    window = torch.hann_window(N_FFT)
    stft = torch.stft(audio, N_FFT, HOP, window=window, center=True, pad_mode="reflect", return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()
    filters = torch.from_numpy(mel_filters(n_mels)).to(torch.float32)
    log_spec = torch.clamp(filters.T @ power, min=1e-10).log10()
    # Per chunk, as Whisper's extractor does for each padded 30 s input.
    floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0
    return (torch.maximum(log_spec, floor) + 4.0) / 4.0


def decode_wav(data: bytes, *, field: str = "audio", max_seconds: float = 600.0) -> np.ndarray:
    """A PCM WAV file (8/16/32-bit, any rate, any channels) -> 16 kHz mono float32 in [-1, 1].

    Channels are averaged; another rate is resampled by linear interpolation
    (adequate for speech features; a 16 kHz source is used as is).
    """
    try:
        with wave.open(io.BytesIO(data)) as wav:
            channels, width, rate, frames = wav.getnchannels(), wav.getsampwidth(), wav.getframerate(), wav.getnframes()
            if frames / max(rate, 1) > max_seconds:
                raise MediaError(field, f"audio of {frames / rate:.1f} s is longer than {max_seconds:.0f} s")
            raw = wav.readframes(frames)
    except (wave.Error, EOFError) as error:
        raise MediaError(field, f"not a PCM WAV file ({error})") from error
    kinds = {1: (np.uint8, 128.0, 128.0), 2: (np.int16, 0.0, 32768.0), 4: (np.int32, 0.0, 2147483648.0)}
    if width not in kinds:
        raise MediaError(field, f"unsupported WAV sample width of {width} bytes")
    dtype, offset, scale = kinds[width]
    samples = (np.frombuffer(raw[: len(raw) - len(raw) % (width * channels)], dtype=dtype).astype(np.float32) - offset) / scale
    mono = samples.reshape(-1, channels).mean(axis=1)
    if rate != SAMPLE_RATE and mono.size:
        target = int(round(mono.size * SAMPLE_RATE / rate))
        mono = np.interp(np.arange(target) * (rate / SAMPLE_RATE), np.arange(mono.size), mono).astype(np.float32)
    return mono
