"""hypothesis over the control-link frame decoder: whatever bytes arrive, the only error
that escapes is FrameRefused, and every valid frame comes back as it was sent."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muster import wire
from muster.wire import HEADER, MAC_SIZE, FrameRefused, Kind, LinkCodec

KEY = b"k" * 32
FUZZ = settings(max_examples=300, deadline=None)

kinds = st.sampled_from(list(Kind))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=16,
)
bodies = st.dictionaries(st.text(), json_values, max_size=6)


def sender() -> LinkCodec:
    return LinkCodec(KEY, send=wire.TO_CONTROLLER, receive=wire.TO_AGENT)


def receiver() -> LinkCodec:
    return LinkCodec(KEY, send=wire.TO_AGENT, receive=wire.TO_CONTROLLER)


def decode_all_ways(data: bytes) -> None:
    """Feed ``data`` to every decoder; anything but FrameRefused fails the test."""
    for decode in (
        receiver().decode,
        lambda d: wire.decode_plain(d, Kind.AUTH),
        lambda d: wire.decode_plain(d, Kind.CHALLENGE),
    ):
        with contextlib.suppress(FrameRefused):
            decode(data)


@st.composite
def valid_frames(draw: st.DrawFn) -> bytes:
    """A MAC'd frame as the agent sends it, or a handshake frame."""
    kind, body = draw(kinds), draw(bodies)
    if draw(st.booleans()):
        return wire.encode_plain(kind, body)
    return sender().encode(kind, body)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_are_refused_or_parsed(data: bytes) -> None:
    decode_all_ways(data)


@FUZZ
@given(
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=256),
)
def test_any_header_is_refused_or_parsed(
    ver: int, kind: int, seq: int, size: int, rest: bytes
) -> None:
    """Every header value, big length fields and unknown kinds included."""
    decode_all_ways(HEADER.pack(ver, kind, seq, size) + rest)


@FUZZ
@given(valid_frames(), st.data())
def test_truncated_frames_are_refused(frame: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(frame) - 1))
    decode_all_ways(frame[:cut])
    with pytest.raises(FrameRefused) as refused:
        receiver().decode(frame[:cut])
    assert refused.value.reason == "malformed"


@FUZZ
@given(valid_frames(), st.data())
def test_bit_flips_are_refused_or_parsed(frame: bytes, data: st.DataObject) -> None:
    flips = data.draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=4))
    mutated = bytearray(frame)
    for bit in flips:
        mutated[bit // 8] ^= 1 << (bit % 8)
    decode_all_ways(bytes(mutated))


@FUZZ
@given(valid_frames(), st.data())
def test_spliced_frames_are_refused_or_parsed(frame: bytes, data: st.DataObject) -> None:
    """Bytes inserted, deleted or replaced anywhere, the length field fixed up or not."""
    at = data.draw(st.integers(0, len(frame)))
    drop = data.draw(st.integers(0, len(frame) - at))
    insert = data.draw(st.binary(max_size=64))
    mutated = frame[:at] + insert + frame[at + drop :]
    decode_all_ways(mutated)
    if len(mutated) >= HEADER.size + MAC_SIZE and data.draw(st.booleans()):
        ver, kind, seq, _ = HEADER.unpack_from(mutated)
        size = len(mutated) - HEADER.size - MAC_SIZE
        decode_all_ways(HEADER.pack(ver, kind, seq, size) + mutated[HEADER.size :])


@FUZZ
@given(kinds, bodies)
def test_mac_frames_round_trip(kind: Kind, body: dict[str, Any]) -> None:
    out, into = sender(), receiver()
    for seq in (1, 2):
        frame = into.decode(out.encode(kind, body))
        assert (frame.kind, frame.seq, frame.body) == (kind, seq, body)


@FUZZ
@given(kinds, bodies)
def test_handshake_frames_round_trip(kind: Kind, body: dict[str, Any]) -> None:
    assert wire.decode_plain(wire.encode_plain(kind, body), kind) == body


@FUZZ
@given(kinds, bodies)
def test_a_frame_is_accepted_once_and_only_in_its_direction(
    kind: Kind, body: dict[str, Any]
) -> None:
    frame = sender().encode(kind, body)
    into = receiver()
    into.decode(frame)
    for codec, reason in ((into, "replayed"), (sender(), "forged")):
        with pytest.raises(FrameRefused) as refused:
            codec.decode(frame)
        assert refused.value.reason == reason


@pytest.mark.parametrize(
    "payload",
    [
        b'{"a":' + b"9" * 400 + b"}",  # a number past a double
        b"[" * 5000,  # nesting past the JSON parser's depth limit
        b'{"a":NaN}',
        b'{"a":"\\ud800"}',  # a lone surrogate
        b"\xff\xfe",
        b"[]",
        b"null",
    ],
)
def test_payloads_json_cannot_read_are_malformed(payload: bytes) -> None:
    frame = HEADER.pack(wire.VERSION, Kind.AUTH, 0, len(payload)) + payload + wire.ZERO_MAC
    with pytest.raises(FrameRefused) as refused:
        wire.decode_plain(frame, Kind.AUTH)
    assert refused.value.reason == "malformed"
