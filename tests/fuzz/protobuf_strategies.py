"""Hypothesis strategies for any protobuf message, built from its descriptor.

``messages(Descriptor)`` draws a message of that type with every field
possibly set to an awkward value: extreme and out-of-range-looking integers,
NaN and infinite floats, empty and oversized strings and bytes, ids that
name nothing (or are not ids at all), enum numbers the schema does not
know, repeated fields of odd sizes and nested messages down to a depth.
``garbage()`` draws raw bytes for the deserializer itself: truncated
varints, wrong wire types, invalid UTF-8 in string fields.

Widen the net by adding values to the ``_INTERESTING_*`` pools below; a
field's strategy can be replaced per test with ``overrides`` (full field
name, e.g. ``"phalanx.router.v1.GenerateRequest.prompt"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import descriptor as _descriptor, message_factory
from google.protobuf.message import Message
from hypothesis import strategies as st

__all__ = ["BOGUS_IDS", "garbage", "messages", "message_class"]

FD = _descriptor.FieldDescriptor

# Strings that break naive handling: empty, separators of subjects and keys, NUL, non-ASCII, very long.
BOGUS_IDS = [
    "", " ", "nope", "never-existed-0", "a" * 129, "../../etc/passwd", "w.1", "*", ">", "a/b", "\x00", "é", "💥",
    "00000000-0000-0000-0000-000000000000",
]
_OVERSIZED_TEXT = ["x" * 70_000, "é" * 300_000]  # beyond any sane prompt or id; under gRPC's 4 MiB message limit
_OVERSIZED_BYTES = [b"\x00" * 70_000, b"\xff" * (1 << 20)]


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = {v for v in (lo, hi, 0, 1, -1, lo + 1, hi - 1, 16, 255, 4096, 65_535, 2**31 - 1, -(2**31), 2**32 - 1) if lo <= v <= hi}
    return st.one_of(st.sampled_from(sorted(edges)), st.integers(lo, hi), st.integers(max(lo, -3), min(hi, 300)))


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FD.TYPE_DOUBLE: st.one_of(st.sampled_from([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324]), st.floats()),
    FD.TYPE_FLOAT: st.one_of(st.sampled_from([0.0, float("nan"), float("inf"), float("-inf"), 3.4e38]), st.floats(width=32)),
    FD.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: _ints(0, 2**32 - 1),
    FD.TYPE_FIXED32: _ints(0, 2**32 - 1),
    FD.TYPE_UINT64: _ints(0, 2**64 - 1),
    FD.TYPE_FIXED64: _ints(0, 2**64 - 1),
    FD.TYPE_BOOL: st.booleans(),
    # Oversized values one draw in ten or so: most messages stay small enough to reach the handler's own checks.
    FD.TYPE_STRING: st.one_of(*[st.text(max_size=24), st.sampled_from(BOGUS_IDS)] * 4, st.sampled_from(_OVERSIZED_TEXT)),
    FD.TYPE_BYTES: st.one_of(*[st.binary(max_size=64)] * 8, st.sampled_from(_OVERSIZED_BYTES)),
}
_REPEATED_SIZES = st.one_of(st.integers(0, 4), st.sampled_from([0, 1, 17, 300]))


def message_class(descriptor: _descriptor.Descriptor) -> type[Message]:
    return message_factory.GetMessageClass(descriptor)


def _field(field: FD, depth: int, overrides: Mapping[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    if field.full_name in overrides:
        return overrides[field.full_name]
    if field.type == FD.TYPE_MESSAGE:
        return messages(field.message_type, depth=depth - 1, overrides=overrides) if depth > 0 else st.just(message_class(field.message_type)())
    if field.type == FD.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, max(known) + 1, 2**31 - 1]))
    return _SCALARS[field.type]


def _repeated(field: FD, element: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    # Long lists of a cheap element (its first draw repeated) keep 300-long fields from costing 300 draws.
    return st.one_of(st.lists(element, max_size=4), st.tuples(element, _REPEATED_SIZES).map(lambda pair: [pair[0]] * pair[1]))


def messages(
    descriptor: _descriptor.Descriptor, *, depth: int = 2, overrides: Mapping[str, st.SearchStrategy[Any]] | None = None
) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type, each field unset or set to a drawn (often hostile) value."""
    overrides = overrides or {}
    cls = message_class(descriptor)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        is_map = field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry
        if is_map:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            strategy: st.SearchStrategy[Any] = st.dictionaries(_field(key, depth, overrides), _field(value, depth, overrides), max_size=3)
        elif field.is_repeated:
            strategy = _repeated(field, _field(field, depth, overrides))
        else:
            strategy = _field(field, depth, overrides)
        # An overridden field is always set: the override is what the caller needs it to be.
        fields[field.name] = strategy if field.full_name in overrides else st.none() | strategy

    def build(values: dict[str, Any]) -> Message:
        message = cls()
        for name, value in values.items():
            if value is not None:
                _assign(message, descriptor.fields_by_name[name], value)
        return message

    return st.fixed_dictionaries(fields).map(build)


def _assign(message: Message, field: FD, value: Any) -> None:
    target = getattr(message, field.name)
    if field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        for k, v in value.items():
            if value_field.type == FD.TYPE_MESSAGE:
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        if field.type == FD.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FD.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def garbage(descriptor: _descriptor.Descriptor | None = None) -> st.SearchStrategy[bytes]:
    """Bytes that are not (or barely) a serialized message: random, truncated, wrong wire types, invalid UTF-8."""
    crafted = [b"\x80", b"\xff" * 11, b"\x08", b"\x0a\x05ab", b"\x0f", b"\x0a\xff\xff\xff\xff\x0f", b"\x00"]
    if descriptor is not None:
        for field in descriptor.fields:
            tag = field.number << 3
            crafted.append(_varint(tag | 2) + b"\x02\xc3\x28")  # length-delimited: invalid UTF-8 (or a bad nested message)
            crafted.append(_varint(tag | 5) + b"\x01")  # a fixed32 cut short, wherever the field's wire type is
            crafted.append(_varint(tag | 1) + b"\x00" * 8)  # fixed64 where the field is something else
            crafted.append(_varint(tag | 3))  # a deprecated group start with no end
    return st.one_of(st.binary(min_size=1, max_size=96), st.sampled_from(crafted))
