import os
import stat

import pytest

from dtfm.net.errors import KeyFileError
from dtfm.net.identity import (
    Identity,
    load_swarm_key,
    new_swarm_key,
    parse_swarm_key,
    short_id,
    verify_signature,
)


def test_generate_sign_verify():
    ident = Identity.generate()
    assert len(ident.peer_id) == 32
    assert ident.short_id == ident.peer_id.hex()[:8]
    sig = ident.sign(b"hello")
    assert len(sig) == 64
    assert verify_signature(ident.peer_id, b"hello", sig)
    assert not verify_signature(ident.peer_id, b"hellO", sig)
    other = Identity.generate()
    assert not verify_signature(other.peer_id, b"hello", sig)
    bad = bytes([sig[0] ^ 1]) + sig[1:]
    assert not verify_signature(ident.peer_id, b"hello", bad)


@pytest.mark.parametrize("peer_id,sig", [(b"", b"x" * 64), (b"x" * 32, b""), (b"x" * 31, b"x" * 64)])
def test_verify_rejects_bad_lengths(peer_id, sig):
    assert not verify_signature(peer_id, b"data", sig)


def test_load_or_create_persists_with_private_modes(tmp_path):
    d = tmp_path / "data"
    a = Identity.load_or_create(d)
    b = Identity.load_or_create(d)
    assert a.peer_id == b.peer_id
    assert Identity.load(d).peer_id == a.peer_id
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / "identity.key").st_mode) == 0o600
    assert not list(d.glob("*.tmp"))


def test_load_missing_is_clear(tmp_path):
    with pytest.raises(KeyFileError, match="dtfm-peer keygen"):
        Identity.load(tmp_path)


def test_load_garbled_is_clear(tmp_path):
    (tmp_path / "identity.key").write_text("not a key\n")
    with pytest.raises(KeyFileError, match="garbled"):
        Identity.load(tmp_path)


def test_swarm_key_round_trip(tmp_path):
    text = new_swarm_key()
    assert "\n" not in text
    assert new_swarm_key() != text
    p = tmp_path / "swarm.key"
    p.write_text(text + "\n")
    key = load_swarm_key(p)
    assert len(key) == 32
    assert parse_swarm_key(text) == key


def test_swarm_key_missing_and_garbled(tmp_path):
    with pytest.raises(KeyFileError, match="swarm-key new"):
        load_swarm_key(tmp_path / "nope")
    p = tmp_path / "bad"
    for garbage in ["", "dtfm-swarm-key-v1:zz", new_swarm_key()[:-2], new_swarm_key() + "\nextra"]:
        p.write_text(garbage)
        with pytest.raises(KeyFileError, match="garbled"):
            load_swarm_key(p)


def test_short_id():
    assert short_id(bytes(range(32))) == "00010203"
