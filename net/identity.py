"""Peer identity (Ed25519) and swarm key (a shared 32-byte secret).

The peer id is the 32-byte Ed25519 public key. The private seed lives in
`<data_dir>/identity.key` (mode 0600, directory 0700) as one line of text.
The swarm key file holds one line, `dtfm-swarm-key-v1:<64 hex chars>`, then one line
`dtfm-operator-v1:<64 hex chars>` per operator of the swarm: the Ed25519 public keys whose
signatures start, stop and reschedule training runs (their private keys: net/operator.py).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import nacl.exceptions
import nacl.signing
import nacl.utils

from dtfm.files import atomic_write

from .errors import KeyFileError

IDENTITY_FILE = "identity.key"
_IDENTITY_PREFIX = "dtfm-identity-v1:"
_SWARM_KEY_PREFIX = "dtfm-swarm-key-v1:"
_OPERATOR_PREFIX = "dtfm-operator-v1:"
MAX_OPERATORS = 64  # operator lines a swarm key file may hold
PEER_ID_BYTES = 32
SIGNATURE_BYTES = 64
SWARM_KEY_BYTES = 32


def short_id(peer_id: bytes) -> str:
    """First 8 hex characters of a peer id, for logs and tables."""
    return peer_id[:4].hex()


class Identity:
    """An Ed25519 identity key pair."""

    __slots__ = ("_signing_key", "peer_id", "short_id")

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError("an identity seed is 32 bytes")
        self._signing_key = nacl.signing.SigningKey(seed)
        self.peer_id: bytes = bytes(self._signing_key.verify_key)
        self.short_id: str = short_id(self.peer_id)

    def __repr__(self) -> str:
        return f"Identity({self.short_id})"

    @classmethod
    def generate(cls) -> "Identity":
        return cls(nacl.utils.random(32))

    @property
    def seed(self) -> bytes:
        return bytes(self._signing_key)

    def sign(self, data: bytes) -> bytes:
        """64-byte detached Ed25519 signature of `data`."""
        return self._signing_key.sign(bytes(data)).signature

    @classmethod
    def load(cls, data_dir: Path) -> "Identity":
        path = Path(data_dir) / IDENTITY_FILE
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            raise KeyFileError(
                f"no identity key at {path}: create one with `dtfm-peer keygen --data-dir {data_dir}`"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise KeyFileError(f"cannot read identity key {path}: {e}") from None
        seed = _parse_hex_line(text, _IDENTITY_PREFIX, 32)
        if seed is None:
            raise KeyFileError(
                f"identity key {path} is garbled (expected one line '{_IDENTITY_PREFIX}<64 hex>'); "
                "restore it from a backup or move it away and run `dtfm-peer keygen`"
            )
        return cls(seed)

    @classmethod
    def load_or_create(cls, data_dir: Path) -> "Identity":
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(data_dir, 0o700)
        path = data_dir / IDENTITY_FILE
        if path.exists():
            return cls.load(data_dir)
        ident = cls.generate()
        line = f"{_IDENTITY_PREFIX}{ident.seed.hex()}\n".encode("ascii")
        try:
            # linked into place: fails if another process created the key meanwhile, then use theirs
            atomic_write(path, line, mode=0o600, replace=False)
        except FileExistsError:
            return cls.load(data_dir)
        return ident


def verify_signature(peer_id: bytes, data: bytes, signature: bytes) -> bool:
    """True when `signature` is a valid Ed25519 signature of `data` by `peer_id`."""
    if len(peer_id) != PEER_ID_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        nacl.signing.VerifyKey(bytes(peer_id)).verify(bytes(data), bytes(signature))
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
        return False
    return True


def new_swarm_key() -> str:
    """Text form of a fresh random 32-byte swarm secret (one line, no newline)."""
    return _SWARM_KEY_PREFIX + nacl.utils.random(SWARM_KEY_BYTES).hex()


def parse_swarm_key(text: str) -> bytes:
    """The swarm secret of a swarm key file's text (its operator lines are checked too)."""
    return parse_swarm_file(text)[0]


def parse_swarm_file(text: str) -> tuple[bytes, tuple[bytes, ...]]:
    """(the swarm secret, the operators' public keys) of a swarm key file's text."""
    lines = [line.strip() for line in text.strip().splitlines()]
    key = _parse_hex_line(lines[0], _SWARM_KEY_PREFIX, SWARM_KEY_BYTES) if lines else None
    if key is None:
        raise KeyFileError(
            f"garbled swarm key (expected a first line '{_SWARM_KEY_PREFIX}<64 hex>'): "
            "make one with `dtfm-peer swarm-key new --out FILE` and share that file"
        )
    operators: list[bytes] = []
    for n, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        op = _parse_hex_line(line, _OPERATOR_PREFIX, PEER_ID_BYTES)
        if op is None:
            raise KeyFileError(f"garbled swarm key file: line {n} is not '{_OPERATOR_PREFIX}<64 hex>' "
                               "(an operator's public key, as `dtfm-peer operator-key new` prints it)")
        if op not in operators:
            operators.append(op)
    if len(operators) > MAX_OPERATORS:
        raise KeyFileError(f"the swarm key file names {len(operators)} operators, at most {MAX_OPERATORS}")
    return key, tuple(operators)


def operator_line(public_key: bytes) -> str:
    """The swarm key file's line that names an operator (no newline)."""
    if len(public_key) != PEER_ID_BYTES:
        raise ValueError("an operator's public key is 32 bytes")
    return _OPERATOR_PREFIX + bytes(public_key).hex()


def load_swarm_key(path: Path) -> bytes:
    """The 32-byte swarm secret stored in `path`."""
    return load_swarm_file(path)[0]


def load_swarm_operators(path: Path) -> tuple[bytes, ...]:
    """The operators' public keys the swarm key file `path` names (maybe none)."""
    return load_swarm_file(path)[1]


def load_swarm_file(path: Path) -> tuple[bytes, tuple[bytes, ...]]:
    """(the swarm secret, the operators' public keys) stored in the swarm key file `path`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise KeyFileError(
            f"no swarm key file at {path}: create one with `dtfm-peer swarm-key new --out {path}` "
            "or copy the file from a swarm member"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read swarm key file {path}: {e}") from None
    try:
        return parse_swarm_file(text)
    except KeyFileError as e:
        raise KeyFileError(f"{path}: {e}") from None


def swarm_key_fingerprint(key: bytes) -> str:
    """Short non-secret fingerprint of a swarm key, safe to log."""
    return hashlib.blake2b(key, digest_size=4, person=b"dtfm-swarm-fp").hexdigest()


def _parse_hex_line(text: str, prefix: str, n: int) -> bytes | None:
    if "\n" in text or not text.startswith(prefix):
        return None
    body = text[len(prefix):]
    if len(body) != 2 * n:
        return None
    try:
        return bytes.fromhex(body)
    except ValueError:
        return None
