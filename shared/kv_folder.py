"""What `--kv-cache-dir` must be, and reading its block files as data that may lie.

The folder holds one file per cached block; whoever can write there can make a worker read anything.
So every level of it that exists (the folder, the fingerprint's, each rank's) must belong to this user and
be closed to writes by anyone else, and one server at a time holds it, so that two never share one size
bound. A block file is opened without following a link and without waiting (a FIFO or a device in its place
is refused at once), and read only if it is a regular file of the size a block's file has.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

LOCK_NAME = ".lock"
_held: dict[str, int] = {}  # folders this process holds: one server per process, which may build its parts again


class KVFolderError(Exception):
    """The folder cannot be used; the message says why and what to do."""


def check_folder(path: str) -> None:
    """Raise KVFolderError unless `path` (if it exists) is a folder of this user's that no one else may write."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise KVFolderError(f"--kv-cache-dir: {path} is not a folder (a link or a file is refused)")
    if info.st_uid != os.geteuid():
        raise KVFolderError(
            f"--kv-cache-dir: {path} belongs to another user (uid {info.st_uid}); give the server a folder of its own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KVFolderError(
            f"--kv-cache-dir: {path} may be written by others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"chmod go-w {path}, or give the server a folder of its own"
        )


def make_folder(path: str) -> None:
    """`path` and the folders above it that are missing, as this user's alone; each level checked."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent and parent != path and not os.path.exists(parent):
        make_folder(parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_folder(path)


def hold(folder: str) -> int:
    """Take `folder` for this server until the process ends (the lock goes with it): a descriptor to keep.
    Raises KVFolderError where another server holds it."""
    make_folder(folder)
    real = os.path.realpath(folder)
    if real in _held:
        return _held[real]
    descriptor = os.open(os.path.join(folder, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(descriptor)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise KVFolderError(
                f"--kv-cache-dir: another server uses {folder}; two servers would hold twice its "
                "size bound between them: give each its own folder"
            ) from None
        raise
    _held[real] = descriptor
    return descriptor


def let_go(folder: str) -> None:
    """Give `folder` up (the process does at exit)."""
    descriptor = _held.pop(os.path.realpath(folder), None)
    if descriptor is not None:
        os.close(descriptor)


def read_file(path: str, size: int) -> bytes | None:
    """The bytes of the regular file at `path` if it has exactly `size` of them; None for anything else (missing,
    a link, a FIFO or device, another size), without blocking on it."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return None
        chunks, left = [], size
        while left:
            chunk = os.read(descriptor, left)
            if not chunk:
                return None  # shorter than it said
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(descriptor)
