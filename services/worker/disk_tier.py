"""KV blocks as files (`--kv-cache-dir`): one file per block and rank, named by its prefix-cache key,
under a folder named by a fingerprint of what its bytes depend on (model, dtype, block layout,
tensor-parallel size), so that a server finds them again after a restart and never reads another
model's.

A file is written to a temporary name and renamed, so it is whole or absent; it carries its key, its
fingerprint, its length and a SHA-256 of all of it, so a torn, truncated, corrupted or foreign file
is refused when read, and the block is computed again. The folder is data, not trusted
(shared/kv_folder.py): it must be this user's alone, and a file is read only if it is a regular file of
a block file's size, opened without following links or waiting. Writes and reads each run on a thread of their
own: the step that asks for a write only gathers the block's bytes, and one that asks for a read only starts it
(its result comes with a later step's, `KVCache.collect_reads`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shared.kv_folder import check_folder, make_folder, read_file

log = logging.getLogger(__name__)

MAGIC = b"PSKVBLK1"
SUFFIX = ".kv"
DISK_STAGING_BLOCKS = 256  # the host cache's least size with --kv-cache-dir: reads from disk land there first


def fingerprint(parts: dict[str, object]) -> str:
    """The folder name for files whose bytes depend on `parts`."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def weight_files(model_dir: str) -> list[tuple[str, int, int]]:
    """(name, size, modification time) of the checkpoint's config and weight files: another checkpoint,
    other files."""
    found = []
    for name in sorted(os.listdir(model_dir)):
        if name == "config.json" or name.endswith((".safetensors", ".bin", ".pt")):
            stat = os.stat(os.path.join(model_dir, name))
            found.append((name, stat.st_size, stat.st_mtime_ns))
    return found


def block_path(directory: str, print_: str, rank: int, key: bytes) -> str:
    return os.path.join(directory, print_, f"rank{rank}", key.hex() + SUFFIX)


class DiskTier:
    def __init__(self, directory: str, print_: str, rank: int, world_size: int):
        self.directory, self.fingerprint, self.rank, self.world_size = directory, print_, rank, world_size
        self.folder = os.path.join(directory, print_, f"rank{rank}")
        check_folder(directory)  # KVFolderError: the worker does not start
        make_folder(self.folder)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self._writes: dict[bytes, Future[None]] = {}  # by key, until done

    def write_many(self, keys: list[bytes], blocks: torch.Tensor) -> None:
        """Persist `blocks` (on the CPU, blocks along dimension 2 as the cache holds them) under `keys`."""
        self._writes = {k: w for k, w in self._writes.items() if not w.done()}
        for index, key in enumerate(keys):
            payload = blocks[:, :, index].contiguous().view(torch.uint8).numpy().tobytes()
            self._writes[key] = self._writer.submit(self._write, key, payload)

    def _write(self, key: bytes, payload: bytes) -> None:
        header = self._header(key, len(payload))
        body = MAGIC + len(header).to_bytes(4, "little") + header + payload
        descriptor, temporary = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        try:
            with os.fdopen(descriptor, "wb") as f:
                f.write(body + hashlib.sha256(body).digest())
            os.replace(temporary, os.path.join(self.folder, key.hex() + SUFFIX))
        except OSError as exc:
            log.warning("could not write a KV block to %s: %s", self.folder, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary)

    def start_read(self, key: bytes, into: torch.Tensor) -> Future[bool]:
        """Fill `into` (a host block) from this rank's file for `key`, on the reader's thread: its future says
        whether the file was there, whole and right (rank 0 also checks every other rank's file, so that its word
        holds for all)."""
        pending = self._writes.pop(key, None)  # written a few steps ago and read back already: it lands first
        return self._reader.submit(self._read_into, key, into, pending)

    def _read_into(self, key: bytes, into: torch.Tensor, pending: Future[None] | None) -> bool:
        if pending is not None:
            pending.result()
        staged = torch.empty_like(into)
        if not self.read(key, staged):
            return False
        into.copy_(staged)
        return True

    def read(self, key: bytes, into: torch.Tensor) -> bool:
        """Fill `into` (a contiguous host block) from this rank's file for `key` now; False if the file is missing
        or not whole and right. Rank 0 also checks every other rank's file, so that its word holds for all."""
        payload = self._payload(self.rank, key, into.numel() * into.element_size())
        if payload is None:
            return False
        into.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        others = range(1, self.world_size) if self.rank == 0 else ()
        return all(self._payload(rank, key, len(payload)) is not None for rank in others)

    def _header(self, key: bytes, payload_bytes: int) -> bytes:
        return json.dumps({"key": key.hex(), "fingerprint": self.fingerprint, "bytes": payload_bytes}).encode()

    def _payload(self, rank: int, key: bytes, expected: int) -> bytes | None:
        path = block_path(self.directory, self.fingerprint, rank, key)
        # Only a regular file of exactly a block file's size is read, and nothing waits on it.
        data = read_file(path, len(MAGIC) + 4 + len(self._header(key, expected)) + expected + 32)
        if data is None:
            return None
        body, digest = data[:-32], data[-32:]
        if len(data) < len(MAGIC) + 36 or not body.startswith(MAGIC) or hashlib.sha256(body).digest() != digest:
            log.warning("refusing a KV block file that is not whole: %s", path)
            return None
        start = len(MAGIC) + 4
        length = int.from_bytes(body[len(MAGIC) : start], "little")
        try:
            header = json.loads(body[start : start + length])
        except ValueError:
            return None
        payload = body[start + length :]
        if (
            header.get("key") != key.hex()
            or header.get("fingerprint") != self.fingerprint
            or header.get("bytes") != expected
            or len(payload) != expected
        ):
            log.warning("refusing a KV block file written for something else: %s", path)
            return None
        return payload

    def flush(self) -> None:
        """Wait for the writes in flight (before the process ends, so that a restart finds them)."""
        for write in self._writes.values():
            write.result()
        self._writes.clear()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown()
        self._reader.shutdown()
