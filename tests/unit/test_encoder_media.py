"""Media decoding for the encoder pool: video frame sampling on videos written here with OpenCV, images, WAV audio."""

import io
import wave

import cv2
import numpy as np
import pytest

from phalanx.encoder_pool.errors import MediaError
from phalanx.encoder_pool.image import decode_image
from phalanx.encoder_pool.mel import decode_wav
from phalanx.encoder_pool.video import FrameSampling, SamplingStrategy, extract_frames, uniform_indices

pytestmark = pytest.mark.unit


def _write_video(path, frames, fps=10.0):
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (width, height))
    assert writer.isOpened()
    for frame in frames:
        writer.write(frame)
    writer.release()
    return path.read_bytes()


def _scenes(tmp_path, scene_lengths, fps=10.0):
    """A video of flat-coloured scenes (each `n` frames of one colour) and the first frame index of each scene."""
    colours = [(0, 0, 0), (255, 255, 255), (0, 0, 200), (0, 200, 0), (200, 0, 0)]
    frames, starts = [], []
    for scene, length in enumerate(scene_lengths):
        starts.append(len(frames))
        frames += [np.full((32, 48, 3), colours[scene % len(colours)], np.uint8)] * length
    return _write_video(tmp_path / "v.avi", frames, fps), starts


def test_uniform_sampling_spreads_frames_over_the_whole_video(tmp_path):
    data, _ = _scenes(tmp_path, [10, 10, 10, 10])
    video = extract_frames(data, FrameSampling(SamplingStrategy.UNIFORM, max_frames=4))
    assert video.source_frames == 40
    assert video.indices == uniform_indices(40, 4) == [5, 15, 25, 35]
    assert len(video.frames) == 4 and video.frames[0].shape == (32, 48, 3)
    # One frame from each scene: black, white, then red, written as OpenCV's BGR (0, 0, 200) and read back as RGB.
    assert video.frames[0].mean() < 10 and video.frames[1].mean() > 245
    assert video.frames[2][..., 0].mean() > 180 and video.frames[2][..., 2].mean() < 20


def test_keyframe_sampling_keeps_the_first_frame_of_each_scene(tmp_path):
    data, starts = _scenes(tmp_path, [7, 12, 5, 9])
    video = extract_frames(data, FrameSampling(SamplingStrategy.KEYFRAME, max_frames=16))
    assert video.indices == starts


def test_fixed_fps_sampling_takes_one_frame_per_period(tmp_path):
    data, _ = _scenes(tmp_path, [25], fps=10.0)
    video = extract_frames(data, FrameSampling(SamplingStrategy.FPS, fps=2.0, max_frames=16))
    assert video.indices == [0, 5, 10, 15, 20]


def test_frame_count_is_capped_uniformly_whatever_the_strategy(tmp_path):
    data, _ = _scenes(tmp_path, [30], fps=10.0)
    video = extract_frames(data, FrameSampling(SamplingStrategy.FPS, fps=10.0, max_frames=3))
    assert len(video.frames) == 3
    assert video.indices == [5, 15, 25]


def test_corrupt_and_overlong_videos_are_invalid_media(tmp_path):
    with pytest.raises(MediaError, match="decodable"):
        extract_frames(b"\x00not a video" * 100, FrameSampling())
    with pytest.raises(MediaError, match="empty"):
        extract_frames(b"", FrameSampling())
    data, _ = _scenes(tmp_path, [20])
    with pytest.raises(MediaError, match="longer than 10"):
        extract_frames(data, FrameSampling(), max_source_frames=10)


def test_images_decode_to_rgb_and_bad_bytes_are_invalid_media():
    bgr = np.zeros((5, 7, 3), np.uint8)
    bgr[..., 0] = 255  # blue in OpenCV's order
    ok, png = cv2.imencode(".png", bgr)
    assert ok
    rgb = decode_image(png.tobytes())
    assert rgb.shape == (5, 7, 3) and rgb[..., 2].min() == 255 and rgb[..., 0].max() == 0
    with pytest.raises(MediaError, match="decodable"):
        decode_image(b"GIF89a-but-not-really")
    with pytest.raises(MediaError, match="larger than 20"):
        decode_image(png.tobytes(), max_pixels=20)


def _wav(samples, rate, width=2, channels=1):
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


def test_wav_audio_is_decoded_to_16khz_mono_floats():
    tone = (np.sin(np.arange(8000) * 2 * np.pi * 440 / 8000) * 16000).astype(np.int16)
    audio = decode_wav(_wav(tone, 8000))
    assert audio.dtype == np.float32 and audio.size == 16000
    assert abs(np.abs(audio).max() - 16000 / 32768) < 0.01
    stereo = np.stack([tone, -tone], axis=1)
    assert np.abs(decode_wav(_wav(stereo, 8000, channels=2))).max() < 1e-6  # channels averaged
    with pytest.raises(MediaError, match="WAV"):
        decode_wav(b"RIFF0000WAVEjunk")
    with pytest.raises(MediaError, match="longer than"):
        decode_wav(_wav(tone, 8000), max_seconds=0.5)
