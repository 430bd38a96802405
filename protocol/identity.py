"""Ed25519 identities: key files, node ids, sign/verify of raw bytes.

A node id is the lowercase hex of the 32-byte raw public key (docs/PROTOCOL.md, "Signed requests").
Key files are PKCS#8 PEM, mode 0600; a key readable by group or others is refused.
"""
from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import KeyFileError, UsageError

PUBLIC_KEY_HEX_LEN = 64
SIGNATURE_HEX_LEN = 128


def public_key_hex(pub: Ed25519PublicKey) -> str:
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()


def parse_public_key(hex_key: str) -> Ed25519PublicKey:
    """Parse a 64-char lowercase/uppercase hex public key; ValueError if malformed."""
    if not isinstance(hex_key, str) or len(hex_key) != PUBLIC_KEY_HEX_LEN:
        raise ValueError("public key must be 64 hex characters")
    return _parse_public_key(hex_key)


@functools.lru_cache(maxsize=16384)
def _parse_public_key(hex_key: str) -> Ed25519PublicKey:
    """Cached (the key objects are immutable; errors are not cached): every signed request parses its signer's
    key, ~1.5 % of the coordinator's event loop at 1,000 nodes (bench/load.py --py-spy)."""
    try:
        raw = bytes.fromhex(hex_key)
    except ValueError as e:
        raise ValueError("public key is not hex") from e
    return Ed25519PublicKey.from_public_bytes(raw)


def public_key_arg(flag: str, hex_key: str) -> str:
    """A public key given on the command line (`flag` names the option), lowercased; UsageError if malformed."""
    try:
        parse_public_key(hex_key)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    return hex_key.lower()


def verify_bytes(public_hex: str, signature_hex: str, message: bytes) -> bool:
    """True iff `signature_hex` is a valid Ed25519 signature of `message` by `public_hex`."""
    try:
        pub = parse_public_key(public_hex)
        if len(signature_hex) != SIGNATURE_HEX_LEN:
            return False
        pub.verify(bytes.fromhex(signature_hex), message)
        return True
    except (ValueError, InvalidSignature):
        return False


@dataclass(frozen=True)
class Identity:
    """A private key and everything derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_hex(self) -> str:
        return public_key_hex(self.private_key.public_key())

    @property
    def node_id(self) -> str:
        return self.public_hex

    def private_bytes_raw(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, message: bytes) -> str:
        return self.private_key.sign(message).hex()

    # --- key files ---------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the key as PEM with mode 0600 (atomically; never world-readable, not even briefly)."""
        path = Path(path)
        if path.exists() and not overwrite:
            raise KeyFileError(f"{path} already exists; refusing to overwrite a key")
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Identity":
        path = Path(path)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise KeyFileError(f"key file {path} does not exist") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(
                f"key file {path} is accessible by group/others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run: chmod 600 {path}"
            )
        data = path.read_bytes()
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise KeyFileError(f"key file {path} is not a PEM private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> tuple["Identity", bool]:
        """Load the key at `path`, or create one there. Returns (identity, created)."""
        if Path(path).exists():
            return cls.load(path), False
        ident = cls.generate()
        ident.save(path)
        return ident, True
