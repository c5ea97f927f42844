"""Encryption at rest of captured traffic: chunk blobs in S3 and the workers' spool files.

A chunk holds the token ids of users' prompts and outputs (and states from which text can be read
back), so the bytes a worker stores are sealed with AES-256-GCM (`cryptography`'s AESGCM):

    b"TIDEENC1" | key id length (1 byte) | key id (ASCII) | nonce (12 random bytes) | ciphertext + tag (16 B)

The associated data is the 8-byte magic plus the key id, so a blob's key id cannot be swapped for
another without failing authentication. The SHA-256 a `ChunkRef` and the S3 metadata carry is the
sealed blob's (what is stored), so transfers are checked before decryption as before.

Keys: a `Keyring` of named 256-bit keys; the first is the *current* one (new blobs), every key
decrypts (rotation: put a new key first, keep the old ones until retention has deleted what they
sealed). From the environment (`tide.blobs.StorageSettings`): `TIDE_DATA_KEYS` =
"id:base64key,id2:base64key" or `TIDE_DATA_KEY_FILE`, a file with one "id:base64key" a line
(`#` comments); both may be given (the variable's keys first). No key: blobs are stored in the
clear (`Keyring.empty()`), and a sealed blob cannot be read (ChunkUnauthentic).
A blob that fails authentication (tampered, truncated, or sealed with a key not in the ring) raises
`Unauthentic`; the trainer dead-letters it (the quarantine of corrupt chunks) and counts it.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"TIDEENC1"
NONCE_BYTES = 12  # GCM's standard nonce; random per blob (2^-32 collision odds after 2^32 blobs per key)
KEY_BYTES = 32  # AES-256
_KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Unauthentic(ValueError):
    """A sealed blob that does not decrypt: tampered, truncated, or its key is not in the ring."""


class KeyringError(ValueError):
    """A malformed key specification (the message names the problem, never the key)."""


@dataclass(frozen=True)
class Keyring:
    """Named AES-256 keys; `keys[0]` seals, all open. Immutable; safe to share across threads."""

    keys: tuple[tuple[str, bytes], ...] = ()

    @classmethod
    def empty(cls) -> Keyring:
        return cls(())

    @classmethod
    def parse(cls, spec: str) -> Keyring:
        """Keys from "id:base64key" items separated by commas or newlines (`#` starts a comment)."""
        keys: list[tuple[str, bytes]] = []
        items = (i for line in spec.splitlines() for i in line.split("#", 1)[0].split(","))  # a comment may hold ","
        for item in items:
            item = item.strip()
            if not item:
                continue
            kid, sep, b64 = item.partition(":")
            kid = kid.strip()
            if not sep or not _KEY_ID.fullmatch(kid):
                raise KeyringError(
                    f"expected 'id:base64key' with an id of [A-Za-z0-9_.-]{{1,64}}, got an item starting {kid[:16]!r}"
                )
            try:
                key = base64.b64decode(b64.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise KeyringError(f"key {kid!r} is not base64") from None
            if len(key) != KEY_BYTES:
                raise KeyringError(f"key {kid!r} has {len(key)} bytes, AES-256 needs {KEY_BYTES}")
            if any(k == kid for k, _ in keys):
                raise KeyringError(f"key id {kid!r} given twice")
            keys.append((kid, key))
        return cls(tuple(keys))

    @classmethod
    def load(cls, spec: str = "", path: str = "") -> Keyring:
        """The ring of `TIDE_DATA_KEYS` (spec) followed by the keys of `TIDE_DATA_KEY_FILE` (path)."""
        ring = cls.parse(spec)
        if path:
            try:
                text = Path(path).read_text()
            except OSError as e:
                raise KeyringError(f"cannot read the data key file {path}: {e.strerror}") from None
            more = cls.parse(text)
            ids = {k for k, _ in ring.keys}
            ring = cls(ring.keys + tuple(k for k in more.keys if k[0] not in ids))
        return ring

    @property
    def current(self) -> str:
        """The id of the key new blobs are sealed with ("" = none: stored in the clear)."""
        return self.keys[0][0] if self.keys else ""

    def seal(self, plaintext: bytes) -> bytes:
        """`plaintext` sealed with the current key; returned unchanged when the ring is empty."""
        if not self.keys:
            return plaintext
        kid, key = self.keys[0]
        head = MAGIC + bytes([len(kid)]) + kid.encode()
        nonce = os.urandom(NONCE_BYTES)
        return head + nonce + AESGCM(key).encrypt(nonce, plaintext, head)

    def open(self, blob: bytes) -> bytes:
        """The plaintext of a sealed blob; a blob that is not sealed is returned as it is."""
        if not is_sealed(blob):
            return blob
        kid = sealed_key_id(blob)
        key = dict(self.keys).get(kid)
        if key is None:
            raise Unauthentic(f"sealed with key {kid!r}, which is not configured (TIDE_DATA_KEYS / TIDE_DATA_KEY_FILE)")
        n = len(MAGIC) + 1 + len(kid)
        head, nonce, body = bytes(blob[:n]), bytes(blob[n : n + NONCE_BYTES]), bytes(blob[n + NONCE_BYTES :])
        try:
            return AESGCM(key).decrypt(nonce, body, head)
        except InvalidTag:
            raise Unauthentic(f"fails authentication with key {kid!r} (tampered or truncated)") from None


def is_sealed(blob: bytes) -> bool:
    return bytes(blob[: len(MAGIC)]) == MAGIC


def sealed_key_id(blob: bytes) -> str:
    """The key id in a sealed blob's header ("" for a blob stored in the clear)."""
    if not is_sealed(blob):
        return ""
    n = blob[len(MAGIC)] if len(blob) > len(MAGIC) else 0
    kid = bytes(blob[len(MAGIC) + 1 : len(MAGIC) + 1 + n])
    if len(kid) != n or not n:
        raise Unauthentic("truncated sealed header")
    return kid.decode("ascii", "replace")


def new_key_line(key_id: str) -> str:
    """A fresh "id:base64key" line (tide up's generated key file, `tidectl data new-key`)."""
    if not _KEY_ID.fullmatch(key_id):
        raise KeyringError(f"bad key id {key_id!r}")
    return f"{key_id}:{base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()}"


def ensure_key_file(path: str | Path, key_id: str) -> bool:
    """Create `path` (mode 0600) holding one fresh key line named `key_id` unless it exists; True
    when it was created. An existing file is kept as it is (the same key across restarts) and must
    hold at least one key (KeyringError otherwise, naming the file, never a key). Used by `tide up`
    and docker-compose's `datakeys` step, so that a default stack seals what it stores."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"# TIDE data key (AES-256-GCM), generated once: keep it secret, back it up\n"
                         f"{new_key_line(key_id)}\n".encode())
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.link(tmp, path)  # atomic, and never over a file another process created meanwhile
            return True
        except FileExistsError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
    if not Keyring.load(path=str(path)).keys:
        raise KeyringError(f"the data key file {path} holds no key")
    return False


def main(argv: list[str] | None = None) -> int:
    """`python -m tide.datakeys PATH [KEY_ID]`: ensure_key_file (docker-compose's one-shot step)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m tide.datakeys PATH [KEY_ID]", file=sys.stderr)
        return 2
    try:
        created = ensure_key_file(args[0], args[1] if len(args) > 1 else "k1")
    except (KeyringError, OSError) as e:
        print(f"tide.datakeys: {e}", file=sys.stderr)
        return 1
    print(f"data key file {args[0]}: {'created' if created else 'kept (exists)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
