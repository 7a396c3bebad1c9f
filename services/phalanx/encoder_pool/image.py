"""Image decoding and CLIP preprocessing with OpenCV and numpy (no PIL, no torchvision).

The steps are CLIPImageProcessor's: RGB, resize so the shortest edge is
``size`` (bicubic), center crop ``crop`` x ``crop``, scale to [0, 1],
normalise by the CLIP mean and std, channels first. OpenCV's bicubic
differs from PIL's on downscaling (PIL widens its kernel to antialias), so
we downscale with INTER_AREA, which averages like PIL's antialiased kernel;
the parity test bounds the remaining difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from phalanx.encoder_pool.errors import MediaError

__all__ = ["CLIP_MEAN", "CLIP_STD", "ImageProcessing", "decode_image"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def decode_image(data: bytes, *, field: str = "image", max_pixels: int = 40_000_000) -> np.ndarray:
    """PNG/JPEG/WebP/BMP bytes -> (height, width, 3) uint8 RGB. Raises MediaError for anything else or a corrupt file."""
    if not data:
        raise MediaError(field, "empty image")
    buffer = np.frombuffer(data, dtype=np.uint8)
    # Read the header first: a decompression bomb is refused before its pixels are allocated.
    if _header_pixels(data) > max_pixels:
        raise MediaError(field, f"image larger than {max_pixels} pixels")
    image = cv2.imdecode(buffer, cv2.IMREAD_COLOR)
    if image is None:
        raise MediaError(field, "not a decodable image (supported: PNG, JPEG, WebP, BMP)")
    if image.shape[0] * image.shape[1] > max_pixels:
        raise MediaError(field, f"image of {image.shape[1]}x{image.shape[0]} is larger than {max_pixels} pixels")
    return np.ascontiguousarray(image[:, :, ::-1])


def _header_pixels(data: bytes) -> int:
    """Width x height read from a PNG header (0 when not a PNG: the other formats are checked after decoding)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big") * int.from_bytes(data[20:24], "big")
    return 0


@dataclass(frozen=True)
class ImageProcessing:
    """CLIPImageProcessor's defaults for a tower of ``crop`` x ``crop`` pixels."""

    size: int = 224
    crop: int = 224
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    def resize(self, rgb: np.ndarray) -> np.ndarray:
        height, width = rgb.shape[:2]
        short, long = (height, width) if height <= width else (width, height)
        new_long = int(self.size * long / short)
        new_h, new_w = (self.size, new_long) if height <= width else (new_long, self.size)
        if (new_h, new_w) == (height, width):
            return rgb
        interpolation = cv2.INTER_AREA if new_h < height else cv2.INTER_CUBIC
        return cv2.resize(rgb, (new_w, new_h), interpolation=interpolation)

    def center_crop(self, rgb: np.ndarray) -> np.ndarray:
        height, width = rgb.shape[:2]
        if height < self.crop or width < self.crop:
            raise ValueError(f"{width}x{height} is smaller than the {self.crop} crop")
        top, left = (height - self.crop) // 2, (width - self.crop) // 2
        return rgb[top : top + self.crop, left : left + self.crop]

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        """(H, W, 3) uint8 RGB -> (3, crop, crop) float32, normalised."""
        scaled = self.center_crop(self.resize(rgb)).astype(np.float32) * np.float32(1 / 255)
        normalised = (scaled - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(normalised.transpose(2, 0, 1), dtype=np.float32)
