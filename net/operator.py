"""The operator key: the Ed25519 key whose signatures start, stop and reschedule training runs.

A swarm names its operators by their public keys in the swarm key file (net/identity.py); an
operator keeps the private seed in a file of its own, one line `dtfm-operator-key-v1:<64 hex>`,
stored like a peer's identity key: written with mode 0600 whatever the umask (a temporary file
beside it, then linked into place, never over an existing key unless asked), and refused when
its group or others may read it. `dtfm-peer swarm-key new --out FILE` makes FILE's operator key
beside it, `FILE.operator` (`operator_key_path`); `dtfm-peer train` and `dtfm-swarm` sign with it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from dtfm.files import atomic_write

from .errors import KeyFileError
from .identity import Identity

__all__ = ["OPERATOR_KEY_SUFFIX", "OperatorKey", "operator_key_path"]

OPERATOR_KEY_SUFFIX = ".operator"
_PREFIX = "dtfm-operator-key-v1:"


def operator_key_path(swarm_key_file: Path) -> Path:
    """Where the operator key made with a swarm key file is kept: beside it, FILE.operator."""
    p = Path(swarm_key_file)
    return p.with_name(p.name + OPERATOR_KEY_SUFFIX)


class OperatorKey:
    """An operator's Ed25519 key pair."""

    __slots__ = ("_identity", "path")

    def __init__(self, seed: bytes, path: Path | None = None) -> None:
        self._identity = Identity(seed)
        self.path = path

    def __repr__(self) -> str:
        return f"OperatorKey({self._identity.short_id})"

    @classmethod
    def generate(cls) -> OperatorKey:
        return cls(secrets.token_bytes(32))

    @property
    def public_key(self) -> bytes:
        """The 32-byte public key the swarm key file names."""
        return self._identity.peer_id

    @property
    def short_id(self) -> str:
        return self._identity.short_id

    def sign(self, data: bytes) -> bytes:
        """64-byte detached Ed25519 signature of `data`."""
        return self._identity.sign(data)

    @classmethod
    def load(cls, path: Path) -> OperatorKey:
        """The key in `path`; KeyFileError when it is missing, garbled, or readable by the
        file's group or by others (it signs for the operator: only its owner may read it)."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise KeyFileError(f"no operator key at {path}: make one with `dtfm-peer swarm-key new --out FILE` "
                               "(FILE.operator) or `dtfm-peer operator-key new --out FILE`, or give the one "
                               "you have with --operator-key FILE") from None
        except OSError as e:
            raise KeyFileError(f"cannot read operator key {path}: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"operator key {path} is not a regular file")
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                raise KeyFileError(f"operator key {path} has mode {mode:04o}: other users may read it and act as "
                                   f"the swarm's operator; fix it with `chmod 600 {path}` (and make a new key if "
                                   "someone else may have read it)")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(4096)
        finally:
            os.close(fd)
        seed = _parse_seed(raw)
        if seed is None:
            raise KeyFileError(f"operator key {path} is garbled (expected one line '{_PREFIX}<64 hex>')")
        return cls(seed, path)

    @classmethod
    def create(cls, path: Path, *, replace: bool = False) -> OperatorKey:
        """A new key written to `path` (mode 0600); KeyFileError if `path` exists, unless
        `replace`."""
        path = Path(path)
        key = cls.generate()
        key.path = path
        line = f"{_PREFIX}{key._identity.seed.hex()}\n".encode("ascii")
        try:
            atomic_write(path, line, mode=0o600, replace=replace)
        except FileExistsError:
            raise KeyFileError(f"{path} exists; not overwriting an operator key (use --force to replace it)") from None
        except OSError as e:
            raise KeyFileError(f"cannot write {path}: {e.strerror or e}") from None
        return key



def _parse_seed(raw: bytes) -> bytes | None:
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    if "\n" in text or not text.startswith(_PREFIX) or len(text) != len(_PREFIX) + 64:
        return None
    try:
        return bytes.fromhex(text[len(_PREFIX):])
    except ValueError:
        return None
