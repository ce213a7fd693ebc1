"""The C kernels of this package, loaded with ctypes.

An installed package carries them prebuilt (`kernels/prebuilt/`, made by setup.py when the wheel
is built) for each instruction set in `VARIANTS`, and the CPU's flags choose one at run time, so
an image built on one host runs on another and needs no compiler. A source tree, or a kernel
with no variant for this CPU, is compiled for this CPU (`-march=native`) on first use into a
private cache directory, named by a digest of the source, the flags, the compiler and the CPU,
so a changed source or a different machine gets a fresh build. With neither, `load` returns
None and callers use torch. A worker's `--cpu-kernels` (kernels/choice.py) runs one variant's build instead, and
the tests run each one this CPU can against the portable one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import queue
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from kernels.recordings import Recording

log = logging.getLogger("pagedserve.kernels")

SOURCES = Path(__file__).parent
FLAG_SETS = (  # the vector math library where glibc has one; plain -lm elsewhere
    ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC"],
    ["-O3", "-ffast-math", "-fPIC"],
)
LIBRARIES = (["-lmvec", "-lm"], ["-lm"])
PREBUILT = SOURCES / "prebuilt"
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
# Prebuilt variants, best first, with the CPU flags each needs (as /proc/cpuinfo names them).
VARIANTS = {
    "x86-64-v4-bf16": (
        ["-O3", "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-ffast-math", "-fopenmp-simd", "-fPIC"],
        _AVX512 | {"avx512_bf16", "avx512_vnni"},
    ),
    "x86-64-v4": (["-O3", "-march=x86-64-v4", "-ffast-math", "-fopenmp-simd", "-fPIC"], _AVX512),
    "x86-64-v3": (["-O3", "-march=x86-64-v3", "-ffast-math", "-fopenmp-simd", "-fPIC"], {"avx2", "fma", "f16c"}),
    "portable": (["-O3", "-ffast-math", "-fPIC"], set()),
}
# The CPU flags of AMX tiles for bfloat16 and for int8: the kernels that take them ask Linux for them as well.
AMX_BF16 = frozenset({"amx_tile", "amx_bf16"})
AMX_INT8 = frozenset({"amx_tile", "amx_int8"})
# Builds for the tests only: the AVX-512 kernels' layout, and the arithmetic of the bfloat16 dot
# product, in AVX2 code, so that a machine without AVX-512 runs them against the others.
EMULATED = {
    "x86-64-v3-as-v4-bf16": (
        VARIANTS["x86-64-v3"][0] + ["-DGEMM_VEC=16", "-DGEMM_BF16_DOT_EMULATED"],
        VARIANTS["x86-64-v3"][1],
    )
}
# A variant's name (kernels/choice.py sets it): every kernel from that build (from source if need be). A plain
# attribute, as setup.py loads this module with the standard library alone.
forced_build: str | None = None
_loaded: dict[tuple[str, str | None], ctypes.CDLL | None] = {}
_variant_of: dict[str, str] = {}  # the variant each loaded library is, by its path


def load(name: str, variant: str | None = None) -> ctypes.CDLL | None:
    """The compiled `kernels/<name>.c`, or None where it cannot be built here: the best prebuilt
    variant this CPU runs, else a build for this CPU; with `variant` (or the chosen `forced_build`), that
    variant's build, or None where this CPU cannot run it."""
    variant = variant or forced_build
    if (name, variant) not in _loaded:
        _loaded[name, variant] = _build_and_load(name) if variant is None else _load_variant(name, variant)
    return _loaded[name, variant]


def variant_of(library: ctypes.CDLL) -> str:
    """Which build `library` is: a name of VARIANTS or EMULATED, or "native" (for this CPU)."""
    return _variant_of.get(library._name, "native")


def best_variant() -> str:
    """The first of VARIANTS whose instructions this CPU has: the prebuilt build an installed package runs."""
    flags = cpu_flags()
    return next(name for name, (_, needs) in VARIANTS.items() if needs <= flags)


def runnable_variants() -> list[str]:
    """The variants (and test-only emulations) whose instructions this CPU has, best first."""
    flags = cpu_flags()
    return [name for name, (_, needs) in (VARIANTS | EMULATED).items() if needs <= flags]


def function(name: str, symbol: str, argument_types: list, result_type=None, variant: str | None = None):
    """A typed ctypes function of the compiled `kernels/<name>.c` (in `variant`'s build, if given),
    or None where it cannot be built or where its C signature (`<symbol>_signature`) differs from
    these types: a call with the wrong types would corrupt memory, so the kernel is left to torch."""
    library = load(name, variant)
    if library is None:
        return None
    wanted = signature(argument_types, result_type)
    described = getattr(library, f"{symbol}_signature")
    described.restype = ctypes.c_char_p
    if described().decode() != wanted:
        log.error(
            "%s.c's %s takes %s, where its caller passes %s: it runs in torch",
            name,
            symbol,
            described().decode(),
            wanted,
        )
        return None
    kernel = getattr(library, symbol)
    kernel.argtypes, kernel.restype = argument_types, result_type
    call = profiled(kernel, f"pagedserve::{name}.{symbol}")
    setattr(call, "task", _task(library, symbol))  # noqa: B010 (a function's attribute: read with getattr)
    return call


class Task:
    """A kernel's entry for the C helpers (helper_pool.c): `<symbol>_task(words, counters, thread,
    wait)`, which takes the kernel's arguments before its counters as `words` 64-bit words."""

    __slots__ = ("address", "words", "array")

    def __init__(self, address: int, words: int):
        self.address, self.words = address, words
        self.array = ctypes.c_int64 * words  # the type its words are passed in


def _task(library: ctypes.CDLL, symbol: str) -> Task | None:
    words = getattr(library, f"{symbol}_task_words", None)
    described = getattr(library, f"{symbol}_task_words_signature", None)
    if words is None or described is None:
        return None
    described.restype = ctypes.c_char_p
    if described().decode() != ":i":
        return None
    words.restype = ctypes.c_int64
    address = ctypes.cast(getattr(library, f"{symbol}_task"), ctypes.c_void_p).value
    return Task(address, words()) if address is not None else None


def profiled(kernel: Callable, label: str) -> Callable:
    """`kernel`, seen by torch's profiler as a range named `label` on the thread that calls it,
    while the profiler records that thread (a ctypes call is no torch operator, so the profiler
    would otherwise fold it into its caller). The libraries are plain C, not torch extensions, so
    one build serves every torch version; the signature check above is what keeps a call from
    passing the wrong types."""

    def call(*args):
        if open_recording is not None and not open_recording.inside:
            open_recording.refuse(f"{label} was called outside share_task")
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

_threads = 0  # set_threads; 0: torch's thread count
# The recording open on the model's thread, if any (kernels/recordings.py): share_task adds each call to it,
# and any other way of calling a kernel refuses it. An object of its own module, as this one is loaded by
# setup.py with the standard library alone.
open_recording: Recording | None = None
_helpers: list[queue.SimpleQueue] = []


def set_threads(count: int) -> None:
    """How many threads share a kernel call that is worth splitting: the caller and count - 1 helpers."""
    global _threads
    _threads = max(1, count)


def threads() -> int:
    return _threads or torch_threads()


def torch_threads() -> int:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 1


def new_counters() -> ctypes.Array:
    """The claim counters of one shared call (claims.h), passed to the kernel as this object so that
    the runs keep it alive: fresh for each call, as a helper that arrives late must find its own
    call's chunks all claimed, never another's."""
    return (ctypes.c_int64 * 2)()


def share(run: Callable[[int, bool], object], count: int, label: str = "pagedserve::kernel") -> object:
    """`run(0, True)` on this thread, and `run(i, False)` for i in 1..count-1 on helper threads; the
    result of this thread's. The kernel behind `run` claims its chunks from counters all the runs
    share (claims.h) and returns on this thread once every chunk is done: so a helper that has not
    started by then, because its core is busy with the api, the scheduler or anything else, holds
    up nothing; it joins later to find nothing left. A kernel called through ctypes lets go of the
    GIL, so the runs compute side by side. torch's profiler records only the thread it started on
    unless told to record them all, so there a shared call shows as one range: `label` and the count."""
    if open_recording is not None:
        open_recording.refuse(f"{label} was shared by Python threads")
    for helper in range(1, count):
        _helper_queue(helper).put(functools.partial(run, helper, False))
    if count > 1 and _profiling():
        with _profiler_range(f"{label} on {count} threads"):
            return run(0, True)
    return run(0, True)


def share_units(kernel: Callable, args: tuple, units: int, worth_sharing: bool, per_thread: int) -> object:
    """`kernel(*args, units_per_chunk, counters, wait)` over its `units` (panels, rows) in chunks,
    about `per_thread` of them a thread, shared by every thread where `worth_sharing`; the
    caller's result."""
    count = min(threads(), units) if worth_sharing else 1
    per_chunk = -(-units // (count * per_thread)) if count > 1 else max(units, 1)
    task = getattr(kernel, "task", None)
    if task is not None and (count > 1 or open_recording is not None):  # a recording keeps share_task's calls
        done = share_task(task, (*args, per_chunk), count, kernel.__name__)
        if done is not None:
            return done
    if count == 1:
        return kernel(*args, per_chunk, new_counters(), True)
    whole = (*args, per_chunk, new_counters())
    return share(lambda _, wait: kernel(*whole, wait), count, kernel.__name__)


def share_task(task: Task, words: tuple[int | float, ...], count: int, label: str = "pagedserve::kernel") -> int | None:
    """`task` on this thread and on count - 1 of the C helpers (helper_pool.c), which, unlike the
    Python helpers of `share`, need no lock of Python's to start; its result, or None where the
    helpers cannot be built here (the caller then shares the call through `share`). A float among
    `words` goes as its float32 bits."""
    pool = helper_pool()
    if pool is None or len(words) != task.words:
        return None
    try:
        packed = task.array(*cast(tuple[int, ...], words))
    except TypeError:  # a float among them
        packed = task.array(*(float_bits(w) if isinstance(w, float) else w for w in words))
    recording = open_recording
    if recording is not None:
        recording.calls.append((task.address, count, len(words), *packed))
        recording.inside = True
    try:
        if _pool_helpers[0] < count - 1:
            _pool_helpers[0] = pool.start(count - 1)
        if _profiling():
            with _profiler_range(f"{label} on {count} threads"), _profiler_range(label):
                return pool.share(task.address, packed, len(words), count)
        return pool.share(task.address, packed, len(words), count)
    finally:
        if recording is not None:
            recording.inside = False


def float_bits(value: float) -> int:
    """A float32's bits as an integer: how a task's words carry a float."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


class HelperPool:
    """helper_pool.c's functions: start helpers, share a task, hold them off (tests), count their joins."""

    __slots__ = ("start", "share", "replay", "hold", "joins")

    def __init__(self, start: Callable, share: Callable, replay: Callable, hold: Callable, joins: Callable):
        self.start, self.share, self.replay, self.hold, self.joins = start, share, replay, hold, joins


_pool_helpers = [0]  # C helpers started in this process


@functools.cache
def helper_pool() -> HelperPool | None:
    """helper_pool.c's functions, or None where it cannot be built."""
    p, i = POINTER, INT64
    parts = [
        function("helper_pool", symbol, types, result)
        for symbol, types, result in (
            ("pool_start", [i], i),
            ("pool_share", [p, p, i, i], i),
            ("pool_replay", [p, i], i),
            ("pool_hold", [i], None),
            ("pool_joins", [], i),
        )
    ]
    if None in parts:
        return None
    return HelperPool(*parts)


def _helper_queue(index: int) -> queue.SimpleQueue[Any]:
    while len(_helpers) < index:
        jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        name = f"kernel-helper-{len(_helpers) + 1}"
        threading.Thread(target=_help, args=(jobs,), name=name, daemon=True).start()
        _helpers.append(jobs)
    return _helpers[index - 1]


def _help(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        try:
            job()
        except Exception:  # a helper must outlive any one call; the caller's own run reports the failure
            log.exception("a kernel helper's run failed")


def _build_and_load(name: str) -> ctypes.CDLL | None:
    library = _prebuilt(name)
    if library is not None:
        return library
    library = _build(name, list(zip(FLAG_SETS, LIBRARIES)))
    if library is None:
        log.warning("could not compile %s.c: it runs in torch, which is slower", name)
    return library


def _load_variant(name: str, variant: str) -> ctypes.CDLL | None:
    if variant not in VARIANTS and variant not in EMULATED:
        raise ValueError(f"CPU kernels {variant!r}: expected one of {', '.join([*VARIANTS, *EMULATED])}")
    flags, needs = (VARIANTS | EMULATED)[variant]
    if not needs <= cpu_flags():
        log.warning(
            "this CPU lacks %s for the %s kernels: %s runs in torch",
            ", ".join(sorted(needs - cpu_flags())),
            variant,
            name,
        )
        return None
    path = PREBUILT / f"{name}-{variant}.so"
    library = _open(path) if path.exists() else _build(name, [(flags, libraries) for libraries in LIBRARIES])
    if library is not None:
        _variant_of[library._name] = variant
    return library


def _open(path: Path) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("could not load %s: %s", path, exc)
        return None


def _build(name: str, attempts: list[tuple[list[str], list[str]]]) -> ctypes.CDLL | None:
    """The first of `attempts` (compiler flags, libraries) that compiles and loads, built into the
    private cache under a digest of everything that makes the build."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler found: %s runs in torch, which is slower", name)
        return None
    source = SOURCES / f"{name}.c"
    directory = _cache_directory()
    scratch = None
    if directory is None:  # build where no one else can write, load, and leave nothing behind
        directory = scratch = Path(tempfile.mkdtemp(prefix="pagedserve-kernels-"))
    try:
        for flags, libraries in attempts:
            target = _cached(compiler, source, flags, libraries, directory)
            if target is not None and (library := _open(target)) is not None:
                return library
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return None


def _cached(compiler: str, source: Path, flags: list[str], libraries: list[str], directory: Path) -> Path | None:
    """The library these make, in `directory` under a digest of the source, the flags, the compiler and the CPU:
    compiled unless already there; None where it does not compile."""
    digest = hashlib.sha256(
        b"\0".join([*_source_bytes(source), " ".join(flags + libraries).encode(), _machine_identity(compiler)])
    ).hexdigest()[:16]
    target = directory / f"{source.stem}-{digest}.so"
    return target if target.exists() or _compile(compiler, source, flags, libraries, target) else None


def _source_bytes(source: Path) -> list[bytes]:
    """The C file and every header beside it, which it may include."""
    return [source.read_bytes(), *(header.read_bytes() for header in sorted(source.parent.glob("*.h")))]


def _prebuilt(name: str) -> ctypes.CDLL | None:
    """The best prebuilt variant of `name` that this CPU runs, if the package carries one."""
    flags = cpu_flags()
    for variant, (_, needs) in VARIANTS.items():
        path = PREBUILT / f"{name}-{variant}.so"
        if needs <= flags and path.exists() and (library := _open(path)) is not None:
            _variant_of[library._name] = variant
            return library
    return None


def build_prebuilt(target: Path, compiler: str) -> list[Path]:
    """Every kernel in every variant the compiler can make, into `target` (for setup.py). A build this user's
    cache holds already (the same source, flags, compiler and CPU) is copied rather than compiled again."""
    target.mkdir(parents=True, exist_ok=True)
    cache = _cache_directory()

    def build(source: Path, variant: str, flags: list[str]) -> Path | None:
        path = target / f"{source.stem}-{variant}.so"
        for libraries in LIBRARIES:
            if cache is None:
                if _compile(compiler, source, flags, libraries, path):
                    return path
            elif (built := _cached(compiler, source, flags, libraries, cache)) is not None:
                shutil.copyfile(built, path)
                return path
        return None

    jobs = [
        (source, variant, flags) for source in sorted(SOURCES.glob("*.c")) for variant, (flags, _) in VARIANTS.items()
    ]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # each compiler is a process of its own
        return [path for path in pool.map(lambda job: build(*job), jobs) if path is not None]


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
        for command in (
            [compiler, *flags, "-c", "-o", str(objects), str(source)],
            [compiler, "-shared", "-o", str(partial), str(objects), *libraries],
        ):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                log.debug("%s failed: %s", " ".join(command), done.stderr.strip())
                partial.unlink(missing_ok=True)
                return False
    finally:
        objects.unlink(missing_ok=True)
    os.replace(partial, target)  # atomic: a concurrent process loads a whole library or builds its own
    return True


@functools.cache
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
