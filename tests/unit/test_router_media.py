"""The router's pure media decisions: which encoder first, and what an item is expected to cost before decoding."""

import pytest

from phalanx._proto import encoder_pb2, router_pb2
from phalanx.router.media import EmbeddingCache, EncoderSet, estimated_units, split_on_markers

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


def _item(kind, data):
    return router_pb2.MediaInput(kind=kind, data=data)


def test_embedding_cache_keeps_recent_images_and_audio_within_its_bytes():
    cache = EmbeddingCache(max_bytes=250)
    image, audio, video = (_item(router_pb2.MEDIA_KIND_IMAGE, b"cat"), _item(router_pb2.MEDIA_KIND_AUDIO, b"cat"),
                           _item(router_pb2.MEDIA_KIND_VIDEO, b"cat"))
    assert cache.key(video) is None  # frames depend on the request's sampling and budget
    assert cache.key(image) != cache.key(audio)  # the same bytes as another kind are another item
    cache.put(cache.key(image), encoder_pb2.Embedding(rows=1, data=b"i" * 100))
    cache.put(cache.key(audio), encoder_pb2.Embedding(rows=2, data=b"a" * 100))
    assert cache.get(cache.key(image)).data == b"i" * 100  # now the most recently used
    cache.put(cache.key(_item(router_pb2.MEDIA_KIND_IMAGE, b"dog")), encoder_pb2.Embedding(rows=3, data=b"d" * 100))
    assert cache.get(cache.key(audio)) is None and cache.get(cache.key(image)) is not None  # the least recent went
    assert (len(cache), cache.bytes) == (2, 200)
    cache.put(cache.key(_item(router_pb2.MEDIA_KIND_IMAGE, b"big")), encoder_pb2.Embedding(data=b"b" * 251))
    assert len(cache) == 2  # larger than the whole cache: not kept
    assert EmbeddingCache(0).get(EmbeddingCache.key(image)) is None


def test_estimates_price_moving_each_encoders_embeddings_by_its_measured_or_the_configured_bandwidth():
    from phalanx.router.media import MediaEncoder

    encoders = EncoderSet()
    # 576 positions per image x 1,024 values: float32 2.36 MB, bfloat16 half that.
    measured = _registration("a", 0.0, image=5.0)
    measured.CopyFrom(encoder_pb2.EncoderRegistration(
        address="a", llm_hidden_size=1024, image_positions=576, embedding_dtype="float32",
        load=encoder_pb2.EncoderLoad(costs=measured.load.costs, delivery_bytes_per_s=2.0e9),
    ))
    unmeasured = encoder_pb2.EncoderRegistration(
        address="b", llm_hidden_size=1024, image_positions=576, embedding_dtype="bfloat16",
        load=encoder_pb2.EncoderLoad(costs=measured.load.costs),
    )
    encoders.update("put", "measured", measured)
    encoders.update("put", "unmeasured", unmeasured)
    media = [router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_IMAGE, data=b"png")]
    encoder = MediaEncoder(encoders, timeout_s=1.0, max_message_bytes=1 << 20)
    direct, rows = encoder.estimates(media, link_bytes_per_s=1.0e9)
    assert rows == 576
    by_id = {e.encoder_id: e for e in direct}
    assert by_id["measured"].transfer_s == pytest.approx(576 * 1024 * 4 / 2.0e9)  # its own measurement
    assert by_id["unmeasured"].transfer_s == pytest.approx(576 * 1024 * 2 / 1.0e9)  # the configured link, 16-bit rows
    inline, _ = encoder.estimates(media, link_bytes_per_s=1.0e9, through_router=True)
    # Through the router: two hops at the configured bandwidth, whatever the encoder measured on its own sends.
    assert {e.encoder_id: e.transfer_s for e in inline} == pytest.approx(
        {"measured": 2 * 576 * 1024 * 4 / 1.0e9, "unmeasured": 2 * 576 * 1024 * 2 / 1.0e9}
    )
    assert all(e.transfer_s == 0 for e in encoder.estimates(media)[0])  # no link given: no term


def test_estimates_price_the_link_to_each_worker_the_encoder_measured_apart_and_fall_back_for_the_others():
    from phalanx.router.media import MediaEncoder

    encoders = EncoderSet()
    costs = _registration("a", 0.0, image=5.0).load.costs
    nbytes = 576 * 1024 * 4  # one image's float32 rows
    encoders.update("put", "measured", encoder_pb2.EncoderRegistration(
        address="a", llm_hidden_size=1024, image_positions=576, embedding_dtype="float32",
        load=encoder_pb2.EncoderLoad(costs=costs, delivery_bytes_per_s=2.0e9,
                                     delivery_bytes_per_s_by_worker={"w-slow": 1.0e8, "w-fast": 4.0e9, "w-none": 0.0}),
    ))
    # A link measured, the encoder's overall figure not (an older registration): the others get the configured one.
    encoders.update("put", "links-only", encoder_pb2.EncoderRegistration(
        address="b", llm_hidden_size=1024, image_positions=576, embedding_dtype="float32",
        load=encoder_pb2.EncoderLoad(costs=costs, delivery_bytes_per_s_by_worker={"w-slow": 5.0e8}),
    ))
    media = [router_pb2.MediaInput(kind=router_pb2.MEDIA_KIND_IMAGE, data=b"png")]
    encoder = MediaEncoder(encoders, timeout_s=1.0, max_message_bytes=1 << 20)
    by_id = {e.encoder_id: e for e in encoder.estimates(media, link_bytes_per_s=1.0e9)[0]}
    measured, links_only = by_id["measured"], by_id["links-only"]
    assert measured.transfer_to("w-slow") == pytest.approx(nbytes / 1.0e8)  # the link's own
    assert measured.transfer_to("w-fast") == pytest.approx(nbytes / 4.0e9)
    assert measured.transfer_to("w-none") == pytest.approx(nbytes / 2.0e9)  # unmeasured link: the encoder's figure
    assert measured.transfer_to("w-other") == pytest.approx(nbytes / 2.0e9)
    assert links_only.transfer_to("w-slow") == pytest.approx(nbytes / 5.0e8)
    assert links_only.transfer_to("w-other") == pytest.approx(nbytes / 1.0e9)  # the configured default
    # Inline delivery passes through the router: the encoder's links to workers do not count.
    inline = {e.encoder_id: e for e in encoder.estimates(media, link_bytes_per_s=1.0e9, through_router=True)[0]}
    assert inline["measured"].transfer_to("w-slow") == pytest.approx(2 * nbytes / 1.0e9)
