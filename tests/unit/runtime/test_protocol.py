"""The wire format: round trips, signing, sessions (replays), limits, versioning, malformed input, zero copy,
no pickle."""

import hashlib
import hmac
import json
import struct

import numpy as np
import pytest
import torch
import zmq
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pscluster.errors import BadSignature, MalformedMessage, ProtocolError, ReplayedMessage, UnsignedMessage
from pscluster.runtime import protocol
from pscluster.runtime.protocol import Flag, Limits, Message, Op, Sessions, decode, encode

KEY = bytes(range(32))
RUN = 42


def sample(dtype, shape=(3, 4)):
    """Values that use the whole range of ``dtype`` (sign, fraction, extremes)."""
    g = torch.Generator().manual_seed(0)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) * 100
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)
    if t.numel() >= 2:  # extremes catch sign and byte-order mistakes
        t.view(-1)[:2] = torch.tensor([info.min, info.max], dtype=dtype)
    return t


def round_trip(msg: Message, key: bytes = KEY) -> Message:
    return decode(encode(msg, key), key)


LARGE = (130, 130)  # a float32 tensor of this shape is past PACK_LIMIT: it travels in a frame of its own


def resign(frames, key: bytes = KEY, **header):
    """``frames`` with header fields replaced and a fresh, valid signature."""
    fields = dict(zip(("magic", "version", "op", "flags", "task", "run_id", "nonce", "request_id", "step",
                       "value", "wait_us", "count", "salt"), protocol._HEADER.unpack(frames[0])))
    fields.update(header)
    return sign([protocol._HEADER.pack(*fields.values()), *frames[1:-1]], key)


def sign(frames, key: bytes = KEY):
    """``frames`` (without a mac) followed by their valid mac."""
    return [*frames, protocol.mac(key, frames)]


@pytest.fixture
def frames():
    """A signed PUSH of three tensors: two small ones in its pack, one large enough for a frame of its own."""
    return encode(Message(op=Op.PUSH, task=1, run_id=RUN, step=3, ids=[0, 5, 9],
                          tensors=[sample(torch.float32), sample(torch.int64, (2,)), sample(torch.float32, LARGE)]),
                  KEY)


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(protocol._DTYPES), ids=str)
@pytest.mark.parametrize("shape", [(3, 4), (), (0,), (2, 0, 3), (1,) * protocol.MAX_DIMS],
                         ids=["2d", "0-dim", "empty", "empty-3d", "max-dims"])
def test_round_trip_every_dtype_and_shape(dtype, shape):
    t = sample(dtype, shape)
    back = round_trip(Message(op=Op.PARAMS, ids=[9], tensors=[t]))
    assert back.ids == [9]
    (u,) = back.tensors
    assert u.dtype == dtype and u.shape == t.shape
    assert torch.equal(u, t)


def test_a_models_small_tensors_of_every_dtype_travel_in_one_pack_and_arrive_as_views_of_it():
    """A BatchNorm net's shapes: conv weights past PACK_LIMIT, and many small tensors of every dtype (odd sizes,
    so that each one's place in the pack is padded), non-contiguous and empty ones among them."""
    small = [sample(dtype, shape) for dtype in protocol._DTYPES for shape in [(7,), (3, 5), ()]]
    small += [torch.arange(12.0).reshape(3, 4).t(), torch.empty(0, 3),
              sample(torch.float32, (protocol.PACK_LIMIT // 4,))]
    large = [sample(torch.float32, LARGE), sample(torch.bfloat16, (protocol.PACK_LIMIT,))]
    tensors = [*small[:10], large[0], *small[10:], large[1]]
    frames = encode(Message(op=Op.PUSH, ids=list(range(len(tensors))), tensors=tensors), KEY)
    assert len(frames) == 3 + len(large) + 1 + 1  # header, table, json, the large ones, the pack, mac
    back = decode(frames, KEY)
    pack = np.frombuffer(memoryview(frames[-2]), dtype=np.uint8).ctypes.data
    for t, u in zip(tensors, back.tensors):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
        in_pack = any(t is s for s in small) and t.numel()
        assert (pack <= u.data_ptr() < pack + len(frames[-2])) == bool(in_pack)


def test_a_pack_never_grows_past_one_chunk_the_tensors_beyond_go_in_frames_of_their_own():
    tensors = [torch.full((protocol.PACK_LIMIT // 4,), float(k)) for k in range(200)]  # 12.5 MiB of small ones
    frames = encode(Message(op=Op.PUSH, ids=list(range(200)), tensors=tensors), KEY)
    in_pack = protocol.CHUNK_BYTES // protocol.PACK_LIMIT
    assert len(frames) == 3 + (200 - in_pack) + 1 + 1 and len(frames[-2]) == protocol.CHUNK_BYTES
    assert all(torch.equal(u, t) for u, t in zip(decode(frames, KEY).tensors, tensors))


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12.0).reshape(3, 4).t(),
    lambda: torch.arange(24, dtype=torch.int32).reshape(4, 6)[:, ::2],
    lambda: torch.arange(10.0)[3:7],
    lambda: torch.ones(3, requires_grad=True) * 2,
], ids=["transposed", "strided", "offset", "requires-grad"])
def test_round_trip_of_views_and_tensors_that_need_grad(make):
    t = make()
    (u,) = round_trip(Message(op=Op.PUSH, ids=[0], tensors=[t])).tensors
    assert torch.equal(u, t.detach())


def test_header_fields_and_json_meta_survive():
    meta = {"names": ["fc1.weight", "ünïcode"], "nested": {"lr": 0.1, "ok": True, "none": None}}
    msg = Message(op=Op.PUSH_PULL, flags=Flag.STOPPED | Flag.DROPPED, task=65534, run_id=2**32 - 1,
                  request_id=2**64 - 1, step=-5, value=2**62, meta=meta, nonce=bytes(range(16)))
    back = round_trip(msg)
    for name in ("op", "flags", "task", "run_id", "request_id", "step", "value", "meta", "nonce"):
        assert getattr(back, name) == getattr(msg, name), name
    assert back.ids == [] and back.tensors == []


def test_message_without_meta_decodes_to_none():
    assert round_trip(Message(op=Op.HELLO)).meta is None


@pytest.fixture
def pair():
    """Two connected PAIR sockets (in-process transport), closed at teardown."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind(f"inproc://protocol-test-{id(a)}")
    b.connect(f"inproc://protocol-test-{id(a)}")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)


def test_decode_accepts_zmq_frames(pair):
    a, b = pair
    t = torch.randn(1000, 10)
    a.send_multipart(encode(Message(op=Op.PARAMS, ids=[1], tensors=[t]), KEY), copy=False)
    back = decode(b.recv_multipart(copy=False), KEY)
    assert torch.equal(back.tensors[0], t)


# --- the frames on the wire ----------------------------------------------------------------


def test_frames_are_header_table_json_raw_payloads_the_pack_and_mac():
    small = [sample(torch.float32, (3, 4)), sample(torch.bool, (5,)), sample(torch.float64, ())]
    large = [sample(torch.float32, LARGE), sample(torch.int32, (protocol.PACK_LIMIT // 4 + 1,))]
    meta = {"error": "x"}
    tensors = [small[0], large[0], small[1], large[1], small[2]]
    frames = encode(Message(op=Op.PUSH, ids=[0, 1, 2, 3, 4], tensors=tensors, meta=meta), KEY)
    sizes = [memoryview(f).nbytes for f in frames]
    assert len(frames) == 3 + 1 + len(large) + 1
    assert sizes[0] == protocol._HEADER.size and bytes(frames[0][:4]) == protocol.MAGIC
    assert sizes[1] == len(tensors) * protocol._TENSOR.size
    assert [bytes(frames[1])[k * protocol._TENSOR.size + 6] for k in range(5)] == [1, 0, 1, 0, 1]  # packed or not
    assert json.loads(bytes(frames[2])) == meta
    for frame, t in zip(frames[3:-2], large):
        # the raw bytes of the tensor, nothing around them: no pickle, no length prefix
        assert bytes(memoryview(frame)) == t.numpy().tobytes()
    # the pack: the small tensors' raw bytes in table order, each from a multiple of 16 bytes, zeros between
    assert bytes(memoryview(frames[-2])) == (small[0].numpy().tobytes() + small[1].numpy().tobytes() + bytes(11) +
                                             small[2].numpy().tobytes() + bytes(8))
    assert sizes[-1] == protocol.MAC_SIZE
    assert not any(bytes(memoryview(f))[:1] == b"\x80" for f in frames[:3])  # no pickle opcode


def test_encode_does_not_copy_contiguous_payloads():
    t = torch.randn(256, 256)
    frames = encode(Message(op=Op.PUSH, ids=[0], tensors=[t]), KEY)
    assert frames[3].ctypes.data == t.data_ptr()


def test_decode_does_not_copy_payloads(frames):
    received = [bytearray(memoryview(f)) for f in frames]
    msg = decode(received, KEY)
    large, pack = (np.frombuffer(received[k], dtype=np.uint8).ctypes.data for k in (3, 4))
    assert [t.data_ptr() for t in msg.tensors] == [pack, pack + 48, large]
    received[4][:4] = bytes(4)  # the tensor is a view: it sees a change of the frame
    assert msg.tensors[0].view(-1)[0].item() == 0.0


def test_mac_covers_frame_boundaries():
    assert protocol.mac(KEY, [b"ab", b"c"]) != protocol.mac(KEY, [b"a", b"bc"])


def test_mac_is_hmac_sha256_of_the_length_prefixed_frames_payloads_by_their_gmac(frames):
    gmac = AESGCM(hmac.new(KEY, b"pscluster payload GMAC key", hashlib.sha256).digest())
    salt = bytes(frames[0])[-protocol.SALT_SIZE:]

    def item(i, f):
        raw = bytes(memoryview(f))
        if i >= 3:  # a payload: by its AES-GMAC, the nonce the header's salt with the payload's index in its end
            nonce = salt[:8] + (int.from_bytes(salt[8:], "big") ^ (i - 3)).to_bytes(4, "big")
            raw = gmac.encrypt(nonce, b"", raw)
        return struct.pack("!Q", memoryview(f).nbytes) + raw
    signed = b"".join(item(i, f) for i, f in enumerate(frames[:-1]))
    assert len(frames) - 4 == 2  # two payloads
    assert bytes(frames[-1]) == hmac.new(KEY, signed, hashlib.sha256).digest()
    assert protocol.mac(KEY, frames[:-1]) == protocol.mac(KEY, frames[:-1])  # the cached key state is not consumed


def test_every_message_has_a_salt_of_its_own_and_a_tag_cached_for_one_salt_serves_that_salt_only():
    msg = Message(op=Op.PARAMS, ids=[0], tensors=[sample(torch.float32)])
    salts = {bytes(encode(msg, KEY)[0])[-protocol.SALT_SIZE:] for _ in range(100)}
    assert len(salts) == 100
    tags = protocol.PayloadTags()
    first = encode(msg, KEY, tags)  # tags the payload, and keeps its tag
    assert len(tags.tags) == 1 and bytes(first[0])[-protocol.SALT_SIZE:] == tags.salt
    again = encode(msg, KEY, tags)  # the ps's next reply of the same values: the same salt and tag
    assert bytes(again[-1]) == bytes(first[-1]) and decode(again, KEY).tensors[0].equal(msg.tensors[0])
    other = protocol.PayloadTags()
    encode(msg, KEY, other)
    assert other.salt != tags.salt and other.tags != tags.tags
    forged = encode(msg, KEY, protocol.PayloadTags(tags.salt, other.tags))  # tags of another salt
    with pytest.raises(BadSignature):
        decode(forged, KEY)


# --- what decode refuses -------------------------------------------------------------------


def test_a_frame_signed_with_another_clusters_key_is_refused(frames):
    with pytest.raises(BadSignature, match="bad signature") as info:
        decode(frames, bytes(32))
    assert info.value.counter == "bad_signature"


@pytest.mark.parametrize("index", [0, 1, 2, 3, 4, -1], ids=["header", "table", "json", "payload0", "payload1",
                                                             "mac"])
def test_a_flipped_byte_anywhere_is_refused(frames, index):
    frames = [bytearray(memoryview(f)) for f in frames]
    if not frames[index]:
        frames[index] = bytearray(b"x")  # an empty frame gets a byte instead
    else:
        frames[index][len(frames[index]) // 2] ^= 0x01
    with pytest.raises(BadSignature):
        decode(frames, KEY)


@pytest.mark.parametrize("header", [b"", b"z", bytes(protocol.SALT_SIZE + 1)], ids=["empty", "1-byte", "short"])
def test_garbage_with_payload_frames_and_a_short_header_is_refused_as_badly_signed(header):
    with pytest.raises(BadSignature):  # its payload tags take a salt the header cannot hold: computed all the same
        decode([header, b"z", b"z", b"z", b"zz", bytes(protocol.MAC_SIZE)], KEY)


def test_other_protocol_version_says_to_install_the_same_version(frames):
    with pytest.raises(ProtocolError, match="install the same pscluster version") as info:
        decode(resign(frames, version=protocol.PROTOCOL_VERSION + 1), KEY)
    assert f"protocol version {protocol.PROTOCOL_VERSION + 1}" in str(info.value)


@pytest.mark.parametrize("change, error", [
    (lambda f: f[:3], UnsignedMessage),
    (lambda f: f[:-1], UnsignedMessage),
    (lambda f: [*f[:-1], bytes(f[-1])[:-1]], UnsignedMessage),
    (lambda f: [*f[:-1], bytes(protocol.MAC_SIZE)], BadSignature),
    (lambda f: f[:3] + f[4:], BadSignature),
])
def test_unsigned_and_wrongly_signed_messages_are_told_apart(frames, change, error):
    with pytest.raises(error):
        decode(change(frames), KEY)


@pytest.mark.parametrize("change, problem", [
    (lambda f: resign(f[:-2] + [f[-1]]), "tensor table does not match"),
    (lambda f: resign(f, count=4), "tensor table does not match"),
    (lambda f: resign([f[0], f[1][:-1], *f[2:]]), "tensor table does not match"),
    (lambda f: resign(f, magic=b"XXXX"), "not a pscluster message"),
    (lambda f: sign([f[0] + b"\x00", *f[1:-1]]), "malformed header"),
    (lambda f: resign(f, op=99), "unknown op 99"),
    (lambda f: resign(f, flags=128), "flags 128"),
    (lambda f: resign([f[0], f[1][:8] + struct.pack("!Q", 5) + f[1][16:], *f[2:]]),
     "a pack of 64 bytes for packed tensors of 96"),
    (lambda f: resign([f[0], f[1][:152] + struct.pack("!Q", 131) + f[1][160:], *f[2:]]),
     r"tensor 9: 67600 bytes for shape \(131, 130\)"),
    (lambda f: resign([f[0], f[1][:78] + b"\x00" + f[1][79:], *f[2:]]), "tensor table does not match"),
    (lambda f: resign([f[0], f[1][:6] + b"\x02" + f[1][7:], *f[2:]]), "bad tensor descriptor"),
    (lambda f: resign([f[0], bytes(f[1][:4]) + b"\x63" + bytes(f[1][5:]), *f[2:]]), "bad tensor descriptor"),
    (lambda f: resign([*f[:4], bytes(memoryview(f[4]))[:-4], *f[5:]]), "a pack of 60 bytes"),
    (lambda f: resign([*f[:3], bytes(memoryview(f[3]))[:-4], *f[4:]]), r"bytes for shape \(130, 130\)"),
    (lambda f: resign([f[0], f[1], b"{not json", *f[3:]]), "bad JSON frame"),
    (lambda f: resign([f[0], f[1], b"\xff\xfe", *f[3:]]), "bad JSON frame"),
    (lambda f: resign([f[0], f[1], b"[" * 100_000, *f[3:]]), "bad JSON frame"),
    (lambda f: resign([f[0], f[1], b"[1, 2]", *f[3:]]), "holds a list: an object expected"),
    (lambda f: resign([f[0], f[1][:31] + b"\x01" + f[1][32:], *f[2:]]), "bad tensor descriptor"),
    (lambda f: resign([f[0], f[1][:8] + struct.pack("!QQ", 0, 2**49) + f[1][24:], *f[2:]]), "beyond"),
], ids=["missing-payload", "count", "short-table", "magic", "header-size", "op", "flags", "pack-shape", "shape",
        "unpacked-in-the-pack", "packed-flag", "dtype-code", "short-pack", "short-payload", "json", "json-not-utf8",
        "json-nesting", "json-not-object", "dims-past-ndim", "empty-but-huge"])
def test_malformed_messages_are_refused(frames, change, problem):
    with pytest.raises(MalformedMessage, match=problem) as info:
        decode(change(frames), KEY)
    assert info.value.counter == "malformed"


# --- what encode refuses -------------------------------------------------------------------


def test_encode_refuses_unsupported_dtype_naming_the_supported_ones():
    with pytest.raises(ProtocolError, match="complex64 cannot go on the wire: use one of .*torch.float32"):
        encode(Message(op=Op.PUSH, ids=[0], tensors=[torch.zeros(2, dtype=torch.complex64)]), KEY)


def test_encode_refuses_too_many_dims():
    with pytest.raises(ProtocolError, match=f"at most {protocol.MAX_DIMS}"):
        encode(Message(op=Op.PUSH, ids=[0], tensors=[torch.zeros((1,) * (protocol.MAX_DIMS + 1))]), KEY)


def test_encode_refuses_meta_that_is_not_json_instead_of_pickling_it():
    with pytest.raises(TypeError):
        encode(Message(op=Op.INIT, meta={"optimizer": object()}), KEY)


def test_encode_needs_one_id_per_tensor():
    with pytest.raises(ValueError, match="one variable id per tensor"):
        encode(Message(op=Op.PUSH, ids=[0, 1], tensors=[torch.zeros(1)]), KEY)


# --- limits --------------------------------------------------------------------------------


@pytest.mark.parametrize("limits, problem", [
    (Limits(max_tensors=1, max_message_bytes=1000), "2 tensors: at most 1"),  # checked before the signature
    (Limits(max_message_bytes=100), "bytes: at most 100"),
    (Limits(max_json_bytes=5), "JSON frame of 8 bytes: at most 5"),
])
def test_limits_are_checked(limits, problem):
    frames = encode(Message(op=Op.PUSH, ids=[0, 1], tensors=[torch.zeros(2), torch.zeros(3)], meta={"a": 1}), KEY)
    assert decode(frames, KEY).ids == [0, 1]
    with pytest.raises(MalformedMessage, match=problem):
        decode(frames, KEY, limits)


def test_limits_come_before_the_signature():
    garbage = [b"x" * 60] * 8
    with pytest.raises(MalformedMessage):  # too many frames: refused without hashing them
        decode(garbage, KEY, Limits(max_tensors=2, max_message_bytes=1000))
    with pytest.raises(UnsignedMessage):
        decode(garbage, KEY)


def test_peek_op_reads_the_op_of_a_header_and_nothing_else(frames):
    assert protocol.peek_op(frames[0]) == Op.PUSH
    assert protocol.peek_op(b"short") is None


def test_receive_keeps_no_frame_of_a_message_beyond_the_limit(pair):
    a, b = pair
    a.send_multipart([b"x"] * 50)
    a.send_multipart([b"a", b"b"])
    assert b.poll(2000)
    assert protocol.receive(b, 10) is None
    assert [f.bytes for f in protocol.receive(b, 10)] == [b"a", b"b"]  # the next message is intact


# --- sessions: replays ---------------------------------------------------------------------


def hello(sessions: Sessions, request_id: int = 1) -> bytes:
    return sessions.open(Message(op=Op.HELLO, request_id=request_id, nonce=protocol.challenge()))


def test_a_session_takes_increasing_request_ids_only():
    sessions = Sessions()
    nonce = hello(sessions, request_id=1)
    sessions.admit(Message(op=Op.PULL, request_id=2, nonce=nonce))
    sessions.admit(Message(op=Op.PULL, request_id=10, nonce=nonce))  # gaps are fine (ids are per client)
    for stale in (10, 9, 2, 1):
        with pytest.raises(ReplayedMessage, match=f"request id {stale} not after 10"):
            sessions.admit(Message(op=Op.PULL, request_id=stale, nonce=nonce))
    sessions.admit(Message(op=Op.PULL, request_id=11, nonce=nonce))


def test_a_session_nonce_holds_the_challenge_and_a_fresh_tag():
    sessions = Sessions()
    challenge = protocol.challenge()
    nonce = sessions.open(Message(op=Op.HELLO, nonce=challenge))
    assert nonce[:8] == challenge[:8] and nonce[8:] != bytes(8) and len(nonce) == protocol.NONCE_SIZE
    with pytest.raises(ReplayedMessage, match="a replayed HELLO"):
        sessions.open(Message(op=Op.HELLO, nonce=challenge))
    with pytest.raises(MalformedMessage, match="HELLO with a session tag"):
        sessions.open(Message(op=Op.HELLO, nonce=nonce))


def test_frames_of_another_session_or_ps_are_replays():
    mine, other = Sessions(), Sessions()
    theirs = hello(other)
    with pytest.raises(ReplayedMessage, match="session this ps did not open"):
        mine.admit(Message(op=Op.PULL, request_id=5, nonce=theirs))
    hello(mine)
    with pytest.raises(ReplayedMessage, match="session this ps did not open"):
        mine.admit(Message(op=Op.PULL, request_id=5, nonce=theirs[:8] + bytes(8)))


def test_forgotten_sessions_stay_refused():
    sessions = Sessions(capacity=2)
    first = hello(sessions)
    hello(sessions)
    hello(sessions)  # the first is the least recently used: forgotten
    with pytest.raises(ReplayedMessage):
        sessions.admit(Message(op=Op.PULL, request_id=2, nonce=first))


def test_an_active_session_outlives_newer_idle_ones():
    sessions = Sessions(capacity=2)
    active = hello(sessions)
    for request_id in range(2, 6):
        hello(sessions)
        sessions.admit(Message(op=Op.PULL, request_id=request_id, nonce=active))  # used: kept
