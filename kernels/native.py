"""Build a C kernel of this package with the machine's C compiler, once, and load it with ctypes.

The library is compiled for this CPU (`-march=native`) into a private cache directory, named by
a digest of the source, the flags, the compiler and the CPU, so a changed source or a different
machine gets a fresh build. Without a compiler, `load` returns None and callers use torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("pagedserve.kernels")

SOURCES = Path(__file__).parent
FLAG_SETS = (  # the vector math library where glibc has one; plain -lm elsewhere
    ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC"],
    ["-O3", "-ffast-math", "-fPIC"],
)
LIBRARIES = (["-lmvec", "-lm"], ["-lm"])
_loaded: dict[str, ctypes.CDLL | None] = {}


def load(name: str) -> ctypes.CDLL | None:
    """The compiled `kernels/<name>.c`, or None where it cannot be built here."""
    if name not in _loaded:
        _loaded[name] = _build_and_load(name)
    return _loaded[name]


def function(name: str, symbol: str, argument_types: list, result_type=None):
    """A typed ctypes function of the compiled `kernels/<name>.c`, or None where it cannot be built."""
    library = load(name)
    if library is None:
        return None
    kernel = getattr(library, symbol)
    kernel.argtypes, kernel.restype = argument_types, result_type
    return kernel


POINTER, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def run_parts(run: Callable[[int], object], parts: int) -> list:
    """`run(0)`, ..., `run(parts - 1)`, each on a thread of one pool shared by the kernels (a kernel
    called through ctypes lets go of the GIL, so the parts run on as many cores); their results."""
    global _pool, _pool_size
    if parts <= 1:
        return [run(0)]
    if _pool_size < parts:
        _pool, _pool_size = ThreadPoolExecutor(parts, thread_name_prefix="kernel"), parts
    return list(_pool.map(run, range(parts)))


def _build_and_load(name: str) -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler found: %s runs in torch, which is slower", name)
        return None
    source = SOURCES / f"{name}.c"
    identity = _machine_identity(compiler)
    directory = _cache_directory()
    scratch = None
    if directory is None:  # build where no one else can write, load, and leave nothing behind
        directory = scratch = Path(tempfile.mkdtemp(prefix="pagedserve-kernels-"))
    try:
        for flags, libraries in zip(FLAG_SETS, LIBRARIES):
            digest = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(flags + libraries).encode(),
                                                identity])).hexdigest()[:16]
            target = directory / f"{name}-{digest}.so"
            if not target.exists() and not _compile(compiler, source, flags, libraries, target):
                continue
            try:
                return ctypes.CDLL(str(target))
            except OSError as exc:
                log.warning("could not load %s: %s", target, exc)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    log.warning("could not compile %s: it runs in torch, which is slower", source.name)
    return None


def _compile(compiler: str, source: Path, flags: list[str], libraries: list[str], target: Path) -> bool:
    """Compile, then link without -ffast-math: linked with it, the library would switch the
    whole process to flushing subnormal numbers to zero when it loads."""
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    objects = target.with_suffix(f".{os.getpid()}.o")
    try:
        for command in ([compiler, *flags, "-c", "-o", str(objects), str(source)],
                        [compiler, "-shared", "-o", str(partial), str(objects), *libraries]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                log.debug("%s failed: %s", " ".join(command), done.stderr.strip())
                partial.unlink(missing_ok=True)
                return False
    finally:
        objects.unlink(missing_ok=True)
    os.replace(partial, target)  # atomic: a concurrent process loads a whole library or builds its own
    return True


def _machine_identity(compiler: str) -> bytes:
    version = subprocess.run([compiler, "--version"], capture_output=True).stdout
    try:
        cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        cpu = os.uname().machine
    return version + cpu.encode()


def _cache_directory() -> Path | None:
    """A directory only this user can write, so no one else can plant a library in it."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve" / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        status = root.stat()
        if status.st_uid == os.getuid() and not status.st_mode & 0o022:
            return root
    except OSError:
        pass
    return None
