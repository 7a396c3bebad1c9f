"""The router's pure media decisions: which encoder first, and what an item is expected to cost before decoding."""

import pytest

from phalanx._proto import encoder_pb2, router_pb2
from phalanx.router.media import EncoderSet, estimated_units, split_on_markers

pytestmark = pytest.mark.unit

IMAGE, AUDIO = encoder_pb2.MODALITY_IMAGE, encoder_pb2.MODALITY_AUDIO


def _registration(address, backlog_ms, **unit_ms):
    costs = [encoder_pb2.ModalityCost(modality=getattr(encoder_pb2, f"MODALITY_{m.upper()}"), unit_ms=ms) for m, ms in unit_ms.items()]
    return encoder_pb2.EncoderRegistration(address=address, load=encoder_pb2.EncoderLoad(backlog_ms=backlog_ms, costs=costs))


def test_encoders_are_ranked_by_backlog_plus_this_requests_cost():
    encoders = EncoderSet()
    encoders.update("put", "idle-slow", _registration("a", 0.0, image=30.0, audio=100.0))
    encoders.update("put", "busy-fast", _registration("b", 50.0, image=2.0, audio=100.0))
    encoders.update("put", "images-only", _registration("c", 0.0, image=1.0))
    assert [c.encoder_id for c in encoders.ranked({IMAGE: 1})] == ["images-only", "idle-slow", "busy-fast"]
    # 16 images: the fast encoder's backlog is worth waiting for.
    assert [c.encoder_id for c in encoders.ranked({IMAGE: 16})][:2] == ["images-only", "busy-fast"]
    # Audio: only encoders that serve it, and a request with both modalities needs both.
    assert [c.encoder_id for c in encoders.ranked({IMAGE: 1, AUDIO: 1})] == ["idle-slow", "busy-fast"]
    encoders.update("delete", "idle-slow", None)
    assert [c.encoder_id for c in encoders.ranked({AUDIO: 1})] == ["busy-fast"]


def test_units_are_estimated_before_decoding():
    assert estimated_units(router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_IMAGE, data=b"x" * 10**6)) == 1
    assert estimated_units(router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_AUDIO, data=b"x" * (16_000 * 2 * 45))) == 2
    assert estimated_units(router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_VIDEO, data=b"x")) == 8


def test_markers_split_the_text_into_one_more_piece_than_media():
    assert split_on_markers("a <media> b <media>", "<media>") == ["a ", " b ", ""]
    assert split_on_markers("no media here", "<media>") == ["no media here"]
