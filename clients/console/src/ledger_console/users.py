"""The people known to the console: a JSON file of names and scrypt password hashes (hashlib).

The file maps each name to ``scrypt$<n>$<r>$<p>$<salt hex>$<hash hex>``; it is written with mode
0600 and read on every sign-in, so adding or removing a person needs no restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path

# scrypt's cost: 2**14 x 8 uses 16 MiB and tens of milliseconds per sign-in.
_N, _R, _P = 2**14, 8, 1
NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_N, r=_R, p=_P, maxmem=64 * 2**20)
    return f"scrypt${_N}${_R}${_P}${salt.hex()}${digest.hex()}"


def check_password(password: str, stored: str) -> bool:
    """Whether `password` matches `stored` (compared in constant time)."""
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        computed = hashlib.scrypt(
            password.encode(), salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p), maxmem=64 * 2**20
        )
    except ValueError:
        return False
    return hmac.compare_digest(computed.hex(), digest)


# Spent on an unknown name, so that a sign-in takes as long whether the name exists or not.
_DUMMY = hash_password("", salt=b"\0" * 16)


class Users:
    """The users file at `path` (created on the first `set`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _load(self) -> dict[str, str]:
        if not self.path.exists():
            return {}
        data = json.loads(self.path.read_text())
        return {str(k): str(v) for k, v in data.get("users", {}).items()}

    def _save(self, users: dict[str, str]) -> None:
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"users": users}, f, indent=2, sort_keys=True)
        tmp.replace(self.path)

    def names(self) -> list[str]:
        return sorted(self._load())

    def set(self, name: str, password: str) -> None:
        """Adds the person, or changes their password."""
        if not NAME.match(name):
            raise ValueError("a name is 1 to 64 letters, digits or . _ @ -")
        if len(password) < 8:
            raise ValueError("a password has at least 8 characters")
        users = self._load()
        users[name] = hash_password(password)
        self._save(users)

    def exists(self, name: str) -> bool:
        return name in self._load()

    def remove(self, name: str) -> bool:
        users = self._load()
        if users.pop(name, None) is None:
            return False
        self._save(users)
        return True

    def authenticate(self, name: str, password: str) -> bool:
        stored = self._load().get(name)
        if stored is None:
            check_password(password, _DUMMY)
            return False
        return check_password(password, stored)
