"""The C kernels of this package, loaded with ctypes.

An installed package carries them prebuilt (`kernels/prebuilt/`, made by setup.py when the wheel
is built) for each instruction set in `VARIANTS`, and the CPU's flags choose one at run time, so
an image built on one host runs on another and needs no compiler. A source tree, or a kernel
with no variant for this CPU, is compiled for this CPU (`-march=native`) on first use into a
private cache directory, named by a digest of the source, the flags, the compiler and the CPU,
so a changed source or a different machine gets a fresh build. With neither, `load` returns
None and callers use torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
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
PREBUILT = SOURCES / "prebuilt"
# Prebuilt variants, best first, with the CPU flags each needs. The portable cpu_gemm and
# cpu_linear hold no vector code: they decline every call, and torch does the work.
VARIANTS = {
    "x86-64-v3": (["-O3", "-march=x86-64-v3", "-ffast-math", "-fopenmp-simd", "-fPIC"], {"avx2", "fma"}),
    "portable": (["-O3", "-ffast-math", "-fPIC"], set()),
}
_loaded: dict[str, ctypes.CDLL | None] = {}


def load(name: str) -> ctypes.CDLL | None:
    """The compiled `kernels/<name>.c`, or None where it cannot be built here."""
    if name not in _loaded:
        _loaded[name] = _build_and_load(name)
    return _loaded[name]


def function(name: str, symbol: str, argument_types: list, result_type=None):
    """A typed ctypes function of the compiled `kernels/<name>.c`, or None where it cannot be built
    or where its C signature (`<symbol>_signature`) differs from these types: a call with the wrong
    types would corrupt memory, so the kernel is left to torch."""
    library = load(name)
    if library is None:
        return None
    wanted = signature(argument_types, result_type)
    described = getattr(library, f"{symbol}_signature")
    described.restype = ctypes.c_char_p
    if described().decode() != wanted:
        log.error("%s.c's %s takes %s, where its caller passes %s: it runs in torch", name, symbol,
                  described().decode(), wanted)
        return None
    kernel = getattr(library, symbol)
    kernel.argtypes, kernel.restype = argument_types, result_type
    return profiled(kernel, f"pagedserve::{name}.{symbol}")


def profiled(kernel: Callable, label: str) -> Callable:
    """`kernel`, seen by torch's profiler as a range named `label` on the thread that calls it,
    while the profiler records that thread (a ctypes call is no torch operator, so the profiler
    would otherwise fold it into its caller). The libraries are plain C, not torch extensions, so
    one build serves every torch version; the signature check above is what keeps a call from
    passing the wrong types."""
    def call(*args):
        if _profiling():
            with _profiler_range(label):
                return kernel(*args)
        return kernel(*args)

    call.__qualname__ = call.__name__ = label
    return call


def _profiling() -> bool:
    profiler = sys.modules.get("torch.autograd.profiler")
    return profiler is not None and profiler._is_profiler_enabled


def _profiler_range(label: str):
    return sys.modules["torch.autograd.profiler"].record_function(label)


def signature(argument_types: list, result_type=None) -> str:
    codes = {ctypes.c_void_p: "p", ctypes.c_int64: "i", ctypes.c_float: "f", None: "v"}
    return "".join(codes[t] for t in argument_types) + ":" + codes[result_type]


POINTER, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def run_parts(run: Callable[[int], object], parts: int, label: str = "pagedserve::kernel") -> list:
    """`run(0)`, ..., `run(parts - 1)`, each on a thread of one pool shared by the kernels (a kernel
    called through ctypes lets go of the GIL, so the parts run on as many cores); their results.
    torch's profiler records only the thread it started on unless told to record them all, so
    there the parts show as one range, `label` and the number of threads."""
    global _pool, _pool_size
    if parts <= 1:
        return [run(0)]
    if _pool_size < parts:
        _pool, _pool_size = ThreadPoolExecutor(parts, thread_name_prefix="kernel"), parts
    if _profiling():
        with _profiler_range(f"{label} on {parts} threads"):
            return list(_pool.map(run, range(parts)))
    return list(_pool.map(run, range(parts)))


def _build_and_load(name: str) -> ctypes.CDLL | None:
    library = _prebuilt(name)
    if library is not None:
        return library
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


def _prebuilt(name: str) -> ctypes.CDLL | None:
    """The best prebuilt variant of `name` that this CPU runs, if the package carries one."""
    flags = cpu_flags()
    for variant, (_, needs) in VARIANTS.items():
        path = PREBUILT / f"{name}-{variant}.so"
        if needs <= flags and path.exists():
            try:
                return ctypes.CDLL(str(path))
            except OSError as exc:
                log.warning("could not load %s: %s", path, exc)
    return None


def build_prebuilt(target: Path, compiler: str) -> list[Path]:
    """Every kernel in every variant the compiler can make, into `target` (for setup.py)."""
    target.mkdir(parents=True, exist_ok=True)
    built = []
    for source in sorted(SOURCES.glob("*.c")):
        for variant, (flags, _) in VARIANTS.items():
            for libraries in LIBRARIES:
                path = target / f"{source.stem}-{variant}.so"
                if _compile(compiler, source, flags, libraries, path):
                    built.append(path)
                    break
    return built


def cpu_flags() -> set[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


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
