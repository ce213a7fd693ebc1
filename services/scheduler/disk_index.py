"""Which prefix-cache blocks are kept as files under `--kv-cache-dir`, as the scheduler knows them.

The workers write and read the files (services/worker/disk_tier.py); the scheduler keeps their keys,
least recently used first, within `--kv-cache-dir-size`, and removes the files it drops. At start it
lists the folder the workers named (their fingerprint) and takes each key every rank has a file
for, oldest first: that is what makes a restart warm. It holds the folder for as long as it runs, so
that a second server on the same folder is refused rather than doubling its size bound. Only names are
read here; whether a file is whole is the worker's to check when it reads it.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict

from shared.kv_folder import hold

SUFFIX = ".kv"


class DiskIndex:
    def __init__(self, directory: str, fingerprint: str, world_size: int, capacity: int):
        self.lock = hold(directory)  # one server's size bound per folder; KVFolderError where another holds it
        self.folders = [os.path.join(directory, fingerprint, f"rank{rank}") for rank in range(world_size)]
        self.capacity = capacity  # blocks
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        for key in self._found():
            self._keys[key] = None
        while len(self._keys) > self.capacity:
            self.drop(next(iter(self._keys)))

    def _found(self) -> list[bytes]:
        """Keys with a file in every rank's folder, the least recently written first."""
        per_rank = []
        for folder in self.folders:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                return []
            per_rank.append({entry.name: entry for entry in entries if entry.name.endswith(SUFFIX)})
        if not per_rank:
            return []
        names = set(per_rank[0]).intersection(*per_rank[1:])
        keys = []
        for name in sorted(names, key=lambda n: per_rank[0][n].stat().st_mtime_ns):
            with contextlib.suppress(ValueError):
                keys.append(bytes.fromhex(name.removesuffix(SUFFIX)))
        return keys

    def __len__(self) -> int:
        return len(self._keys)

    def holds(self, key: bytes) -> bool:
        return key in self._keys

    def touch(self, key: bytes) -> None:
        """A block of this key was used: it is the last to go."""
        self._keys.move_to_end(key)

    def add(self, key: bytes) -> None:
        """A file for `key` is being written; the least recently used go where the folder is full."""
        if self.capacity <= 0:
            return
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self.drop(next(iter(self._keys)))

    def drop(self, key: bytes) -> None:
        """Forget `key` and remove its files (a file a worker still writes is replaced whole, and found
        again only at the next start, within the size then)."""
        self._keys.pop(key, None)
        for folder in self.folders:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, key.hex() + SUFFIX))
