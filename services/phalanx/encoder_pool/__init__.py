"""The multimodal encoder pool: vision/audio towers, media preprocessing, batching and the encode service."""
