"""The people known to the console and their live sessions: a JSON file of names, scrypt password
hashes (hashlib) and session ids.

``users`` maps each name to ``scrypt$<n>$<r>$<p>$<salt hex>$<hash hex>``; ``sessions`` maps each
name to its live session ids and when each expires (Unix seconds). The file is written with mode
0600 and read on every request, so adding or removing a person, or a session ending, needs no
restart and reaches every copy of a cookie at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


@dataclass
class _Contents:
    users: dict[str, str]
    sessions: dict[str, dict[str, int]]


class Users:
    """The users file at `path` (created on the first write)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _load(self) -> _Contents:
        if not self.path.exists():
            return _Contents({}, {})
        data = json.loads(self.path.read_text())
        return _Contents(
            {str(k): str(v) for k, v in data.get("users", {}).items()},
            {str(k): {str(sid): int(t) for sid, t in v.items()} for k, v in data.get("sessions", {}).items()},
        )

    @contextmanager
    def _changing(self) -> Iterator[_Contents]:
        """The file's contents, written back after the block, under an exclusive lock (a sidecar
        file): the console ending a session and `users add` at the same moment would otherwise
        undo each other's write, and a session ended could come back."""
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            contents = self._load()
            yield contents
            now = time.time()
            sessions = {name: live for name, ids in contents.sessions.items()
                        if name in contents.users and (live := {s: t for s, t in ids.items() if t > now})}
            tmp = self.path.with_suffix(".tmp")
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(out, "w") as f:
                json.dump({"users": contents.users, "sessions": sessions}, f, indent=2, sort_keys=True)
            tmp.replace(self.path)
        finally:
            os.close(fd)  # releases the lock

    def names(self) -> list[str]:
        return sorted(self._load().users)

    def set(self, name: str, password: str) -> None:
        """Adds the person, or changes their password, which ends their sessions."""
        if not NAME.match(name):
            raise ValueError("a name is 1 to 64 letters, digits or . _ @ -")
        if len(password) < 8:
            raise ValueError("a password has at least 8 characters")
        with self._changing() as contents:
            contents.users[name] = hash_password(password)
            contents.sessions.pop(name, None)

    def remove(self, name: str) -> bool:
        """Removes the person and their sessions."""
        with self._changing() as contents:
            if contents.users.pop(name, None) is None:
                return False
            contents.sessions.pop(name, None)
        return True

    def authenticate(self, name: str, password: str) -> bool:
        stored = self._load().users.get(name)
        if stored is None:
            check_password(password, _DUMMY)
            return False
        return check_password(password, stored)

    def start_session(self, name: str, expires: int) -> str | None:
        """A new session id for `name`, live until `expires` (Unix seconds) unless ended first;
        None when the person was removed meanwhile."""
        sid = secrets.token_urlsafe(24)
        with self._changing() as contents:
            if name not in contents.users:
                return None
            contents.sessions.setdefault(name, {})[sid] = expires
        return sid

    def end_session(self, name: str, sid: str) -> None:
        with self._changing() as contents:
            contents.sessions.get(name, {}).pop(sid, None)

    def session_live(self, name: str, sid: str) -> bool:
        """Whether the session `sid` of `name` is live: started, not ended, not expired, and its
        person still known."""
        contents = self._load()
        expires = contents.sessions.get(name, {}).get(sid)
        return name in contents.users and expires is not None and expires > time.time()
