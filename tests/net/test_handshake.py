import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.net.errors import HandshakeError, ProtocolError
from dtfm.net.handshake import MSG1_LEN, REFUSAL, Initiator, PeerHello, Responder, reject_message
from dtfm.net.identity import Identity, swarm_key_fingerprint
from dtfm.net.replay import HelloGuard
from dtfm.net.session import RecvCipher, SendCipher
from dtfm.net.session import RecvCipher as _Recv
from dtfm.net.session import SendCipher as _Send

KEY = bytes(range(32))
A, B = Identity.generate(), Identity.generate()
HELLO_A = PeerHello("eu", ("10.0.0.1", 7000))
HELLO_B = PeerHello("us", ("10.0.0.2", 7001))


def test_cipher_suite_negotiation():
    both = ["aegis256", "chacha20poly1305"]
    for mine, theirs, expect in [
        (both, both, "aegis256"),
        (both, ["chacha20poly1305"], "chacha20poly1305"),
        (["chacha20poly1305"], both, "chacha20poly1305"),
    ]:
        ri, rr = run(Initiator(A, KEY, HELLO_A, mine), Responder(B, KEY, HELLO_B, theirs))
        assert ri.suite == rr.suite == expect
        s, r = SendCipher(ri.send_key, ri.suite), RecvCipher(rr.recv_key, rr.suite)
        assert r.open(bytes(s.seal(b"frame"))) == b"frame"
    with pytest.raises(ProtocolError, match="no common cipher"):
        run(Initiator(A, KEY, HELLO_A, ["aegis256"]), Responder(B, KEY, HELLO_B, ["chacha20poly1305"]))
    with pytest.raises(ValueError):
        Initiator(A, KEY, HELLO_A, ["rot13"])


def run(init, resp):
    msg2 = resp.on_hello(init.first_message())
    msg3, ri = init.on_response(msg2)
    rr = resp.on_finish(msg3)
    return ri, rr


def test_handshake_agrees_keys_and_identities():
    ri, rr = run(Initiator(A, KEY, HELLO_A), Responder(B, KEY, HELLO_B))
    assert ri.peer_id == B.peer_id and rr.peer_id == A.peer_id
    assert ri.hello == HELLO_B and rr.hello == HELLO_A
    assert ri.send_key == rr.recv_key and ri.recv_key == rr.send_key
    assert ri.send_key != ri.recv_key
    ri2, _ = run(Initiator(A, KEY, HELLO_A), Responder(B, KEY, HELLO_B))
    assert ri2.send_key != ri.send_key  # fresh ephemeral keys every time
    s, r = SendCipher(ri.send_key), RecvCipher(rr.recv_key)
    assert r.open(bytes(s.seal(b"frame"))) == b"frame"


def test_swarm_key_mismatch_is_refused_with_detail_kept_by_the_responder():
    init, resp = Initiator(A, KEY, HELLO_A), Responder(B, bytes(32), HELLO_B)
    with pytest.raises(HandshakeError, match="swarm key mismatch") as e:
        resp.on_hello(init.first_message())
    assert swarm_key_fingerprint(bytes(32)) in str(e.value)  # for the responder's own log
    # what the initiator is sent says nothing about the key
    assert reject_message(REFUSAL) == b"DTFM\xff" + REFUSAL.encode()
    with pytest.raises(HandshakeError, match="refused by peer: handshake refused .*same swarm key") as e:
        init.on_response(reject_message(REFUSAL))
    assert swarm_key_fingerprint(KEY) not in str(e.value) and swarm_key_fingerprint(bytes(32)) not in str(e.value)


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def test_hello_carries_the_initiators_clock_under_the_mac():
    now = 1_700_000_000.0
    guard = HelloGuard(skew_s=120)
    for offset_s, ok in [(-121, False), (-119, True), (119, True), (121, False)]:
        init = Initiator(A, KEY, HELLO_A, wall_clock=Clock(now + offset_s))
        resp = Responder(B, KEY, HELLO_B, guard=guard, wall_clock=Clock(now))
        if ok:
            resp.on_hello(init.first_message())
        else:
            with pytest.raises(HandshakeError, match="ago|future"):
                resp.on_hello(init.first_message())
    msg1 = bytearray(Initiator(A, KEY, HELLO_A, wall_clock=Clock(now - 500)).first_message())
    assert len(msg1) == MSG1_LEN
    msg1[5:13] = int(now * 1000).to_bytes(8, "big")  # a stale hello made to look fresh
    with pytest.raises(HandshakeError, match="swarm key mismatch"):
        Responder(B, KEY, HELLO_B, wall_clock=Clock(now)).on_hello(bytes(msg1))


def test_replayed_hello_is_refused_by_a_responder_sharing_the_guard():
    guard = HelloGuard(skew_s=120)
    msg1 = Initiator(A, KEY, HELLO_A).first_message()
    Responder(B, KEY, HELLO_B, guard=guard).on_hello(msg1)
    with pytest.raises(HandshakeError, match="replayed hello"):
        Responder(B, KEY, HELLO_B, guard=guard).on_hello(msg1)
    Responder(B, KEY, HELLO_B, guard=guard).on_hello(Initiator(A, KEY, HELLO_A).first_message())  # a fresh one


def test_version_mismatch():
    init, resp = Initiator(A, KEY, HELLO_A), Responder(B, KEY, HELLO_B)
    msg1 = bytearray(init.first_message())
    msg1[4] = 9
    with pytest.raises(HandshakeError, match="version 9"):
        resp.on_hello(bytes(msg1))


def test_tampered_messages_fail():
    init, resp = Initiator(A, KEY, HELLO_A), Responder(B, KEY, HELLO_B)
    msg2 = bytearray(resp.on_hello(init.first_message()))
    msg2[-1] ^= 1
    with pytest.raises(HandshakeError):
        init.on_response(bytes(msg2))
    init, resp = Initiator(A, KEY, HELLO_A), Responder(B, KEY, HELLO_B)
    msg3, _ = init.on_response(resp.on_hello(init.first_message()))
    with pytest.raises(HandshakeError):
        resp.on_finish(msg3[:-1] + bytes([msg3[-1] ^ 1]))


def test_msg3_replayed_into_another_session_fails():
    init, resp = Initiator(A, KEY, HELLO_A), Responder(B, KEY, HELLO_B)
    msg1 = init.first_message()
    msg3, _ = init.on_response(resp.on_hello(msg1))
    resp2 = Responder(B, KEY, HELLO_B)  # a responder that never saw the hello (no shared guard)
    resp2.on_hello(msg1)  # replayed hello: new responder ephemeral, so old msg3 cannot finish
    with pytest.raises(HandshakeError):
        resp2.on_finish(msg3)


def test_self_connection_refused():
    with pytest.raises(HandshakeError, match="ourselves"):
        run(Initiator(A, KEY, HELLO_A), Responder(A, KEY, HELLO_B))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_raises_protocol_error_only(data):
    with pytest.raises(ProtocolError):
        Responder(B, KEY, HELLO_B).on_hello(data)
    init = Initiator(A, KEY, HELLO_A)
    init.first_message()
    with pytest.raises(ProtocolError):
        init.on_response(data)
    resp = Responder(B, KEY, HELLO_B)
    resp.on_hello(Initiator(A, KEY, HELLO_A).first_message())
    with pytest.raises(ProtocolError):
        resp.on_finish(data)


@pytest.mark.parametrize("suite", ["chacha20poly1305", "aegis256"])
def test_session_cipher_detects_replay_reorder_tamper_and_ratchets(suite):
    def SendCipher(key):  # noqa: N802
        return _Send(key, suite)

    def RecvCipher(key):  # noqa: N802
        return _Recv(key, suite)

    s, r = SendCipher(KEY), RecvCipher(KEY)
    r1, r2 = bytes(s.seal(b"one")), bytes(s.seal(b"two"))
    with pytest.raises(ProtocolError):
        RecvCipher(KEY).open(r2)  # reordered
    assert r.open(r1) == b"one"
    with pytest.raises(ProtocolError):
        r.open(r1)  # replayed
    r = RecvCipher(KEY)
    r.open(r1)
    bad = bytearray(r2)
    bad[6] ^= 0x40
    with pytest.raises(ProtocolError):
        r.open(bytes(bad))
    s, r = SendCipher(KEY), RecvCipher(KEY)
    s.ratchet()
    with pytest.raises(ProtocolError):
        r.open(bytes(s.seal(b"x")))
    s, r = SendCipher(KEY), RecvCipher(KEY)
    s.ratchet()
    r.ratchet()
    assert r.open(bytes(s.seal(b"x"))) == b"x" and s.counter == 1
