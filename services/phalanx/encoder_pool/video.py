"""Frames out of a video with OpenCV: uniform, keyframe (frame difference) or fixed-fps sampling, capped in count.

OpenCV reads from a path, so the bytes go to a private temporary file for
the read. Every strategy decodes sequentially (seeking is unreliable across
codecs) and keeps only the frames it picks, so memory holds at most
``max_frames`` frames. A strategy that picks more than the cap is thinned
uniformly to it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

import cv2
import numpy as np

from phalanx.encoder_pool.errors import MediaError

__all__ = ["FrameSampling", "SamplingStrategy", "VideoFrames", "extract_frames", "uniform_indices"]


class SamplingStrategy(Enum):
    UNIFORM = "uniform"  # `max_frames` frames evenly spread over the video
    KEYFRAME = "keyframe"  # a frame whenever the picture changed by more than `keyframe_threshold` since the last one kept
    FPS = "fps"  # `fps` frames per second of video


@dataclass(frozen=True)
class FrameSampling:
    strategy: SamplingStrategy = SamplingStrategy.UNIFORM
    max_frames: int = 8
    fps: float = 1.0
    # Mean absolute difference of grey levels (0-255) between a frame and the last kept one.
    keyframe_threshold: float = 12.0

    def __post_init__(self) -> None:
        if self.max_frames < 1:
            raise ValueError("max_frames must be at least 1")
        if self.fps <= 0:
            raise ValueError("fps must be positive")


@dataclass(frozen=True)
class VideoFrames:
    frames: list[np.ndarray]  # (H, W, 3) uint8 RGB each
    indices: list[int]  # their positions in the video
    source_fps: float
    source_frames: int


def uniform_indices(total: int, count: int) -> list[int]:
    """`count` indices (fewer when `total` is smaller) spread evenly over range(total), centred in their segments."""
    count = min(count, total)
    if count <= 0:
        return []
    return sorted({int((i + 0.5) * total / count) for i in range(count)})


@contextmanager
def _video_file(data: bytes) -> Iterator[str]:
    fd, path = tempfile.mkstemp(prefix="phalanx-video-")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        yield path
    finally:
        os.unlink(path)


def _frames(capture: cv2.VideoCapture) -> Iterator[np.ndarray]:
    while True:
        ok, frame = capture.read()
        if not ok:
            return
        yield frame


def extract_frames(data: bytes, sampling: FrameSampling, *, field: str = "video", max_source_frames: int = 100_000) -> VideoFrames:
    """Decode `data` (any container/codec this OpenCV build reads) and pick frames by `sampling`."""
    if not data:
        raise MediaError(field, "empty video")
    with _video_file(data) as path:
        capture = cv2.VideoCapture(path)
        try:
            if not capture.isOpened():
                raise MediaError(field, "not a decodable video")
            fps = float(capture.get(cv2.CAP_PROP_FPS)) or 25.0
            declared = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
            if declared > max_source_frames:
                raise MediaError(field, f"video of {declared} frames is longer than {max_source_frames}")
            picked, indices, total = _pick(capture, sampling, fps, declared, max_source_frames, field)
        finally:
            capture.release()
    if not picked:
        raise MediaError(field, "video has no decodable frames")
    if len(picked) > sampling.max_frames:
        keep = uniform_indices(len(picked), sampling.max_frames)
        picked, indices = [picked[i] for i in keep], [indices[i] for i in keep]
    return VideoFrames([np.ascontiguousarray(f[:, :, ::-1]) for f in picked], indices, fps, total)


def _pick(
    capture: cv2.VideoCapture, sampling: FrameSampling, fps: float, declared: int, max_source_frames: int, field: str
) -> tuple[list[np.ndarray], list[int], int]:
    strategy = sampling.strategy
    if strategy is SamplingStrategy.UNIFORM and declared <= 0:
        # No frame count in the container: count by decoding once, then sample on a second pass.
        declared = sum(1 for _ in _frames(capture))
        capture.set(cv2.CAP_PROP_POS_FRAMES, 0)
    wanted = set(uniform_indices(declared, sampling.max_frames)) if strategy is SamplingStrategy.UNIFORM else set()
    step = max(fps / sampling.fps, 1.0)
    picked: list[np.ndarray] = []
    indices: list[int] = []
    last_grey: np.ndarray | None = None
    total = 0
    next_fps_pick = 0.0
    for index, frame in enumerate(_frames(capture)):
        total = index + 1
        if total > max_source_frames:
            raise MediaError(field, f"video is longer than {max_source_frames} frames")
        if strategy is SamplingStrategy.UNIFORM:
            keep = index in wanted
        elif strategy is SamplingStrategy.FPS:
            keep = index >= next_fps_pick
            if keep:
                next_fps_pick += step
        else:
            grey = cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY).astype(np.int16)
            keep = last_grey is None or float(np.abs(grey - last_grey).mean()) > sampling.keyframe_threshold
            if keep:
                last_grey = grey
        if keep:
            picked.append(frame)
            indices.append(index)
    return picked, indices, total
