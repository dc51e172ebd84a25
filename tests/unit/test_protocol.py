"""Unit tests for elasticrun.common.protocol: authenticated, replay-protected control frames."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.common import protocol
from elasticrun.common.protocol import (
    MAC_BYTES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Codec,
    Message,
    ProtocolError,
    new_secret,
    new_sender_id,
)

pytestmark = pytest.mark.timeout(60)

SECRET = bytes(range(32))
JOB = "job-1"


def pair(secret: bytes = SECRET, job: str = JOB) -> tuple[Codec, Codec]:
    """A worker codec and the driver codec that receives its frames."""
    return Codec(secret, job, "worker-a"), Codec(secret, job, "driver")


def forge(payload_obj, secret: bytes = SECRET) -> bytes:
    """A frame with a *valid* MAC over an arbitrary payload (what only a secret holder can make)."""
    payload = payload_obj if isinstance(payload_obj, bytes) else json.dumps(payload_obj).encode()
    return hmac.new(secret, payload, hashlib.sha256).digest() + payload


def header(**overrides):
    obj = {"v": PROTOCOL_VERSION, "t": "hello", "job": JOB, "from": "peer", "seq": 1, "to": None, "body": {}}
    obj.update(overrides)
    return obj


class _JsonCalled(AssertionError):
    pass


def _no_json(*args, **kwargs):
    raise _JsonCalled("json.loads must not be called for a frame with a bad MAC")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
bodies = st.dictionaries(st.text(max_size=10), json_values, max_size=5)


# --- helpers ---------------------------------------------------------------------------------
def test_new_secret_is_random_256_bits():
    a, b = new_secret(), new_secret()
    assert isinstance(a, bytes) and len(a) == 32
    assert a != b


def test_new_sender_id_has_prefix_and_is_unique():
    a, b = new_sender_id("worker"), new_sender_id("worker")
    assert a.startswith("worker-") and len(a) == len("worker-") + 12
    assert a != b


# --- round trip ------------------------------------------------------------------------------
def test_round_trip():
    tx, rx = pair()
    msg = rx.decode(tx.encode("rendezvous", {"host": "a", "slot": 0}))
    assert msg == Message(type="rendezvous", sender="worker-a", seq=1, body={"host": "a", "slot": 0}, to=None)


def test_round_trip_with_recipient_and_empty_body():
    tx, rx = pair()
    msg = rx.decode(tx.encode("ping", to="driver"))
    assert msg.to == "driver" and msg.body == {} and msg.type == "ping"


def test_frame_layout_is_mac_then_json_payload():
    tx, _ = pair()
    frame = tx.encode("x", {"k": 1})
    mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
    assert mac == hmac.new(SECRET, payload, hashlib.sha256).digest()
    obj = json.loads(payload)
    assert obj == {"v": PROTOCOL_VERSION, "t": "x", "job": JOB, "from": "worker-a", "seq": 1, "to": None,
                   "body": {"k": 1}}


def test_sequence_numbers_increase_from_one():
    tx, rx = pair()
    seqs = [rx.decode(tx.encode("m", {"i": i})).seq for i in range(5)]
    assert seqs == [1, 2, 3, 4, 5]


@given(type_=st.text(max_size=30), body=bodies, to=st.one_of(st.none(), st.just("driver")))
@settings(max_examples=200)
def test_round_trip_property(type_, body, to):
    tx, rx = pair()
    msg = rx.decode(tx.encode(type_, body, to=to))
    assert msg.type == type_ and msg.body == body and msg.to == to
    assert msg.sender == "worker-a" and msg.seq == 1


def test_independent_senders_have_independent_sequences():
    _, rx = pair()
    a, b = Codec(SECRET, JOB, "a"), Codec(SECRET, JOB, "b")
    assert rx.decode(a.encode("m")).seq == 1
    assert rx.decode(b.encode("m")).seq == 1
    assert rx.decode(b.encode("m")).seq == 2
    assert rx.decode(a.encode("m")).seq == 2


def test_gaps_in_sequence_are_accepted():
    tx, rx = pair()
    tx.encode("lost")
    assert rx.decode(tx.encode("m")).seq == 2


# --- integrity: the MAC is checked before json parsing ----------------------------------------
def test_flipped_mac_bit_rejected_without_parsing():
    tx, rx = pair()
    frame = bytearray(tx.encode("m", {"a": 1}))
    frame[0] ^= 0x01
    with mock.patch.object(protocol.json, "loads", _no_json):
        with pytest.raises(ProtocolError, match="bad MAC"):
            rx.decode(bytes(frame))


def test_flipped_payload_bit_rejected_without_parsing():
    tx, rx = pair()
    frame = bytearray(tx.encode("m", {"a": 1}))
    frame[-2] ^= 0x40
    with mock.patch.object(protocol.json, "loads", _no_json):
        with pytest.raises(ProtocolError, match="bad MAC"):
            rx.decode(bytes(frame))


@given(body=bodies, data=st.data())
@settings(max_examples=200)
def test_any_single_bit_flip_rejected_before_parsing(body, data):
    tx, rx = pair()
    frame = bytearray(tx.encode("m", body))
    index = data.draw(st.integers(0, len(frame) - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    frame[index] ^= 1 << bit
    with mock.patch.object(protocol.json, "loads", _no_json):
        with pytest.raises(ProtocolError, match="bad MAC"):
            rx.decode(bytes(frame))


def test_bad_frame_does_not_consume_the_sequence_number():
    tx, rx = pair()
    good = tx.encode("m")
    bad = bytearray(good)
    bad[MAC_BYTES + 3] ^= 0x01
    with pytest.raises(ProtocolError):
        rx.decode(bytes(bad))
    assert rx.decode(good).seq == 1


def test_truncated_frame_rejected():
    tx, rx = pair()
    frame = tx.encode("m", {"a": 1})
    with pytest.raises(ProtocolError, match="bad MAC"):
        rx.decode(frame[:-1])


def test_wrong_secret_rejected():
    tx = Codec(b"\x01" * 32, JOB, "worker-a")
    rx = Codec(b"\x02" * 32, JOB, "driver")
    with mock.patch.object(protocol.json, "loads", _no_json):
        with pytest.raises(ProtocolError, match="bad MAC"):
            rx.decode(tx.encode("m"))


@pytest.mark.parametrize("frame", [b"", b"x", b"\x00" * MAC_BYTES])
def test_too_short_rejected(frame):
    _, rx = pair()
    with pytest.raises(ProtocolError, match="too short"):
        rx.decode(frame)


@given(garbage=st.binary(max_size=300))
@settings(max_examples=300)
def test_garbage_bytes_rejected_without_parsing(garbage):
    _, rx = pair()
    with mock.patch.object(protocol.json, "loads", _no_json):
        with pytest.raises(ProtocolError):
            rx.decode(garbage)


# --- replay protection -----------------------------------------------------------------------
def test_replay_of_same_frame_rejected():
    tx, rx = pair()
    frame = tx.encode("m")
    rx.decode(frame)
    with pytest.raises(ProtocolError, match="replayed"):
        rx.decode(frame)


def test_older_seq_rejected():
    tx, rx = pair()
    first, second = tx.encode("m"), tx.encode("m")
    assert rx.decode(second).seq == 2
    with pytest.raises(ProtocolError, match="seq 1"):
        rx.decode(first)


def test_forged_seq_zero_or_negative_rejected():
    _, rx = pair()
    for seq in (0, -1):
        with pytest.raises(ProtocolError, match="replayed"):
            rx.decode(forge(header(seq=seq)))


def test_forget_drops_the_replay_entry():
    tx, rx = pair()
    rx.decode(tx.encode("m"))
    rx.decode(tx.encode("m"))
    assert rx._last_seen == {"worker-a": 2}
    rx.forget("worker-a")
    assert rx._last_seen == {}
    rx.forget("never-seen")  # no error
    # A peer restarting its sequence under the same name is accepted again.
    restarted = Codec(SECRET, JOB, "worker-a")
    assert rx.decode(restarted.encode("m")).seq == 1


def test_the_replay_table_keeps_the_senders_heard_most_recently(monkeypatch):
    """Each worker process sends under new ids: a job replacing workers for days kept an entry
    for every sender it ever heard (a soak: +330 for 143 worker starts). The table is bounded,
    dropping the sender silent the longest; one still talking keeps its replay protection."""
    monkeypatch.setattr(protocol, "MAX_SENDERS", 4)
    rx = Codec(SECRET, JOB, "driver")
    live = Codec(SECRET, JOB, "worker-live")
    old = live.encode("m")
    rx.decode(old)
    for n in range(10):
        rx.decode(Codec(SECRET, JOB, f"worker-{n}").encode("m"))
        rx.decode(live.encode("m"))  # heard again after each newcomer
    assert len(rx._last_seen) == 4 and "worker-live" in rx._last_seen
    assert list(rx._last_seen) == ["worker-7", "worker-8", "worker-9", "worker-live"]
    with pytest.raises(ProtocolError, match="replayed"):
        rx.decode(old)


@given(order=st.permutations(range(6)))
def test_out_of_order_delivery_only_accepts_increasing(order):
    tx, rx = pair()
    frames = [tx.encode("m", {"i": i}) for i in range(6)]
    accepted, highest = [], 0
    for i in order:
        try:
            accepted.append(rx.decode(frames[i]).seq)
        except ProtocolError:
            assert i + 1 <= highest
        else:
            assert i + 1 > highest
            highest = i + 1
    assert accepted == sorted(accepted)


# --- binding to job, recipient, version ------------------------------------------------------
def test_different_job_rejected():
    tx = Codec(SECRET, "job-other", "worker-a")
    _, rx = pair()
    with pytest.raises(ProtocolError, match="job-other"):
        rx.decode(tx.encode("m"))


def test_message_addressed_to_another_recipient_rejected():
    tx, rx = pair()
    with pytest.raises(ProtocolError, match="addressed to 'someone-else'"):
        rx.decode(tx.encode("reply", {}, to="someone-else"))


def test_rejected_recipient_frame_can_not_be_replayed_to_intended_one_after_use():
    driver = Codec(SECRET, JOB, "driver")
    w1, w2 = Codec(SECRET, JOB, "w1"), Codec(SECRET, JOB, "w2")
    reply = driver.encode("assign", {"rank": 0}, to="w1")
    with pytest.raises(ProtocolError, match="addressed"):
        w2.decode(reply)
    assert w1.decode(reply).body == {"rank": 0}
    with pytest.raises(ProtocolError, match="replayed"):
        w1.decode(reply)


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_version_mismatch_rejected(version):
    _, rx = pair()
    with pytest.raises(ProtocolError, match="protocol version"):
        rx.decode(forge(header(v=version)))


def test_forged_frame_with_valid_mac_is_accepted():
    # Sanity check for the helpers used by the tests above.
    _, rx = pair()
    assert rx.decode(forge(header(seq=7))).seq == 7


# --- size limits -----------------------------------------------------------------------------
def test_oversized_frame_rejected_before_mac_and_parse():
    _, rx = pair()
    frame = forge(header(body={"x": "a" * MAX_FRAME_BYTES}))
    assert len(frame) > MAX_FRAME_BYTES
    with mock.patch.object(protocol.json, "loads", _no_json), \
            mock.patch.object(protocol.hmac, "new", side_effect=AssertionError("MAC computed")):
        with pytest.raises(ProtocolError, match="over the"):
            rx.decode(frame)


def test_frame_exactly_at_limit_is_not_rejected_for_size():
    _, rx = pair()
    base = forge(header(body={"x": ""}))
    pad = MAX_FRAME_BYTES - len(base)
    frame = forge(header(body={"x": "a" * pad}))
    assert len(frame) == MAX_FRAME_BYTES
    assert rx.decode(frame).body == {"x": "a" * pad}


def test_encode_refuses_oversized_message():
    tx, _ = pair()
    with pytest.raises(ProtocolError, match="over the"):
        tx.encode("big", {"x": "a" * MAX_FRAME_BYTES})


# --- malformed payloads under a valid MAC ----------------------------------------------------
@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b"\xff\xfe\xfd",
        b"[1, 2, 3]",
        b"null",
        b"42",
        b'"string"',
        json.dumps({k: v for k, v in header().items() if k != "body"}).encode(),
        json.dumps({k: v for k, v in header().items() if k != "seq"}).encode(),
        json.dumps({k: v for k, v in header().items() if k != "from"}).encode(),
        json.dumps({k: v for k, v in header().items() if k != "v"}).encode(),
        json.dumps(header()).encode("utf-16"),  # a payload is UTF-8 (json.loads would guess)
    ],
)
def test_malformed_payload_rejected(payload):
    _, rx = pair()
    with pytest.raises(ProtocolError, match="malformed"):
        rx.decode(forge(payload))


@pytest.mark.parametrize("overrides", [{"seq": "1"}, {"seq": 1.5}, {"seq": None}, {"from": 5},
                                       {"from": None}, {"body": []}, {"body": "x"}])
def test_malformed_header_fields_rejected(overrides):
    _, rx = pair()
    with pytest.raises(ProtocolError, match="malformed header"):
        rx.decode(forge(header(**overrides)))


def test_missing_to_field_means_broadcast():
    _, rx = pair()
    obj = header()
    del obj["to"]
    assert rx.decode(forge(obj)).to is None


def test_deeply_nested_payload_rejected_as_protocol_error():
    _, rx = pair()
    with pytest.raises(ProtocolError):
        rx.decode(forge(b"[" * 100_000))


# --- thread safety ---------------------------------------------------------------------------
def test_concurrent_encode_gives_unique_sequence_numbers():
    tx, rx = pair()
    frames: list[bytes] = []
    lock = threading.Lock()

    def work():
        out = [tx.encode("m") for _ in range(200)]
        with lock:
            frames.extend(out)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = sorted(json.loads(f[MAC_BYTES:])["seq"] for f in frames)
    assert seqs == list(range(1, 801))
    ordered = sorted(frames, key=lambda f: json.loads(f[MAC_BYTES:])["seq"])
    assert [rx.decode(f).seq for f in ordered] == seqs


# --- fuzzing: whatever arrives, decode() raises ProtocolError or returns a well-typed Message ---
def _decode_or_protocol_error(rx: Codec, frame: bytes) -> Message | None:
    """Decode; a refusal must be a ProtocolError with a fixed reason and one short line."""
    try:
        msg = rx.decode(frame)
    except ProtocolError as exc:
        assert isinstance(exc.reason, str) and exc.reason
        assert "\n" not in str(exc) and len(str(exc)) < 300, str(exc)
        return None
    assert isinstance(msg.type, str) and isinstance(msg.sender, str) and isinstance(msg.body, dict)
    assert type(msg.seq) is int and msg.seq > 0 and (msg.to is None or isinstance(msg.to, str))
    return msg


# Any JSON value, including the awkward ones: huge and negative numbers, floats, NaN/inf
# (Python's json reads them), long strings, nested containers.
awkward_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63, max_value=10**300)
    | st.floats() | st.text(max_size=200) | st.just(1) | st.just(JOB) | st.just("driver"),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)
HEADER_FIELDS = ["v", "t", "job", "from", "seq", "to", "body"]


@given(garbage=st.binary(max_size=2000))
@settings(max_examples=300)
def test_fuzz_arbitrary_bytes(garbage):
    _, rx = pair()
    assert _decode_or_protocol_error(rx, garbage) is None


@given(payload=st.binary(max_size=2000))
@settings(max_examples=300)
def test_fuzz_valid_mac_over_arbitrary_bytes(payload):
    _, rx = pair()
    _decode_or_protocol_error(rx, forge(payload))


@given(value=awkward_json)
@settings(max_examples=300)
def test_fuzz_valid_mac_over_arbitrary_json(value):
    _, rx = pair()
    _decode_or_protocol_error(rx, forge(json.dumps(value).encode()))


@given(overrides=st.dictionaries(st.sampled_from(HEADER_FIELDS), awkward_json, min_size=1),
       missing=st.sets(st.sampled_from(HEADER_FIELDS)))
@settings(max_examples=500)
def test_fuzz_header_fields_of_every_type(overrides, missing):
    _, rx = pair()
    obj = {k: v for k, v in header(**overrides).items() if k not in missing}
    _decode_or_protocol_error(rx, forge(json.dumps(obj).encode()))


@pytest.mark.parametrize("text", [
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":' + "9" * 4000 + ',"body":{}}',   # huge: not a counter
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":' + "9" * 5000 + ',"body":{}}',   # over int's digit limit
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":1e999,"body":{}}',
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":NaN,"body":{}}',
    '{"v":1.0,"t":"x","job":"job-1","from":"p","seq":1,"body":{}}',
    '{"v":true,"t":"x","job":"job-1","from":"p","seq":1,"body":{}}',
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":true,"body":{}}',
    '{"v":1,"t":["x"],"job":"job-1","from":"p","seq":1,"body":{}}',
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":1,"to":["driver"],"body":{}}',
    '{"v":1,"t":"x","job":' + '"' + "j" * 100_000 + '"' + ',"from":"p","seq":1,"body":{}}',
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":1,"body":' + "[" * 50_000 + "]" * 50_000 + "}",
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":1,"body":' + '{"a":' * 500 + "1" + "}" * 500 + "}",
    '{"v":1,"t":"x","job":"job-1","from":"p","seq":1,"body":{}}' + " " * 10 + "x",
    "\ufeff{}", '{"v":1,"v":2}', "[" * 200_000,
])
def test_awkward_payloads_are_refused_or_well_typed(text):
    _, rx = pair()
    msg = _decode_or_protocol_error(rx, forge(text.encode()))
    if msg is not None:  # only a deep but legal body may pass
        assert text.startswith('{"v":1,"t":"x"') and '"body":{"a":' in text


def test_booleans_are_not_version_or_sequence_numbers():
    _, rx = pair()
    with pytest.raises(ProtocolError, match="protocol version True"):
        rx.decode(forge(header(v=True)))
    with pytest.raises(ProtocolError, match="malformed header"):
        rx.decode(forge(header(seq=True)))
    with pytest.raises(ProtocolError, match="malformed header"):
        rx.decode(forge(header(t=7)))
    with pytest.raises(ProtocolError, match="malformed header"):
        rx.decode(forge(header(seq=1 << 63)))
    assert rx.decode(forge(header(seq=(1 << 63) - 1))).seq == (1 << 63) - 1


@given(extra=st.integers(1, 4096), head=st.binary(max_size=64))
@settings(max_examples=30)
def test_fuzz_frames_over_the_limit_are_refused_before_hashing_or_parsing(extra, head):
    _, rx = pair()
    frame = head + bytes(MAX_FRAME_BYTES + extra - len(head))
    with mock.patch.object(protocol.json, "loads", _no_json), \
            mock.patch.object(protocol.hmac, "new", side_effect=AssertionError("MAC computed")):
        with pytest.raises(ProtocolError, match="over the") as err:
            rx.decode(frame)
    assert err.value.reason == "too large"


def test_refusals_name_a_fixed_reason():
    tx, rx = pair()
    good = tx.encode("m")
    cases = [(b"x", "too short"), (bytes(MAX_FRAME_BYTES + 1), "too large"), (b"\0" * 40, "bad MAC"),
             (forge(b"nope"), "malformed"), (forge(header(v=2)), "wrong version"),
             (forge(header(job="other")), "wrong job"), (forge(header(to="someone")), "wrong recipient")]
    rx.decode(good)
    cases.append((good, "replayed"))
    for frame, reason in cases:
        with pytest.raises(ProtocolError) as err:
            rx.decode(frame)
        assert err.value.reason == reason, (frame[:40], str(err.value))


def test_messages_with_a_blob_have_an_authenticated_header_naming_its_length():
    from elasticrun.common.protocol import Codec, ProtocolError

    a, b = Codec(b"k" * 32, "job", "a"), Codec(b"k" * 32, "job", "b")
    header, blob = a.encode_with_blob("ckpt_part", {"offset": 8}, b"\x00\x01" * 1000)
    msg, data = b.decode_with_blob(header, bytes(blob))
    assert msg.type == "ckpt_part" and msg.body["offset"] == 8 and data == b"\x00\x01" * 1000
    header, blob = a.encode_with_blob("ckpt_part", {"offset": 8}, b"abc")
    with pytest.raises(ProtocolError, match="length"):
        b.decode_with_blob(header, b"abcd")  # the content is checked end to end (a shard's SHA-256)
    with pytest.raises(ProtocolError, match="bad MAC"):
        Codec(b"x" * 32, "job", "c").decode_with_blob(header, b"abc")


@given(st.integers(0, 1000), st.integers(0, 2**32 - 1), st.integers(1, 1000), st.integers(0, 2**32 - 1))
def test_a_later_rounds_copy_has_the_higher_id_and_reads_as_round_and_commit(r1, c1, later, c2):
    """A restore can take the commit count back down; the copy of the later round still wins."""
    a, b = protocol.copy_id(r1, c1), protocol.copy_id(r1 + later, c2)
    assert b > a
    assert protocol.copy_name(a) == f"round {r1}'s copy of commit {c1}"
