"""What this CPU can do, for `cpu_linear_bench.py` to set its products against: `cpu_peak.c`, built for this CPU,
measures one core's float32 multiply-adds in its widest vectors, its bfloat16 dot product where it has one, int8
products as the W8A8 kernel makes them (AVX512-VNNI's byte dot product, else int16 pairs) and, where the CPU has AMX
tiles, their int8 peak on one core and on every core at once, and the W8A8 kernel's tile loop alone over a weight in
the second-level cache and past it; then the rate at which one thread, and every core at once, reads memory."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import tempfile
import threading
import time

import torch

from kernels import native
from kernels.cpu_int8_linear import int8_build

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_peak.c")


def probe() -> dict:
    """This core's peak GFLOP/s in float32 and in bfloat16, and its read rate from memory in GB/s."""
    with tempfile.TemporaryDirectory() as scratch:
        library = os.path.join(scratch, "cpu_peak.so")
        subprocess.run(["cc", "-O3", "-march=native", "-fPIC", "-shared", "-o", library, PROBE], check=True)
        peak = ctypes.CDLL(library)
    for name in ("fma_rounds", "dot_rounds"):
        getattr(peak, name).argtypes, getattr(peak, name).restype = [ctypes.c_int64], ctypes.c_float
    peak.int8_rounds.argtypes, peak.int8_rounds.restype = [ctypes.c_int64], ctypes.c_int64
    peak.int8_ops_per_round.restype = ctypes.c_int64
    peak.amx_int8_rounds.argtypes, peak.amx_int8_rounds.restype = [ctypes.c_int64], ctypes.c_int64
    peak.amx_int8_ops_per_round.restype = ctypes.c_int64
    peak.read_all.argtypes, peak.read_all.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_float
    width, rounds = peak.vector_width(), 20_000_000
    fma = 24 * width * rounds / min(timed(lambda: peak.fma_rounds(rounds)) for _ in range(3)) / 1e9
    has_dot = peak.dot_rounds(1) != -1.0
    dot = 48 * width * rounds / min(timed(lambda: peak.dot_rounds(rounds)) for _ in range(3)) / 1e9 if has_dot else fma
    int8_ops = peak.int8_ops_per_round()
    int8 = (
        int8_ops * rounds / min(timed(lambda: peak.int8_rounds(rounds)) for _ in range(3)) / 1e9
        if int8_ops > 0
        else fma
    )
    amx_ops, amx_rounds = peak.amx_int8_ops_per_round(), 200_000
    amx = (
        amx_ops * amx_rounds / min(timed(lambda: peak.amx_int8_rounds(amx_rounds)) for _ in range(3)) / 1e9
        if amx_ops > 0 and peak.amx_int8_rounds(1) != -1 and tiles_from_16_rows()
        else None
    )
    # Every core's tiles at once: on a VM whose cores share a physical core's tile unit this is not cores x `amx`.
    amx_every_core = (
        len(os.sched_getaffinity(0))
        * amx_ops
        * amx_rounds
        / min(timed(lambda: on_every_core(peak.amx_int8_rounds, amx_rounds)) for _ in range(3))
        / 1e9
        if amx is not None
        else None
    )
    tile_loop = tile_loop_rates(peak) if amx is not None else None
    data = torch.ones(256 << 18)  # 256 MiB
    read = data.nbytes / min(timed(lambda: peak.read_all(data.data_ptr(), data.nbytes)) for _ in range(5)) / 1e9
    every_core = data.nbytes / min(timed(lambda: read_in_parallel(peak, data)) for _ in range(5)) / 1e9
    return {
        "vector_floats": width,
        "f32_gflops": round(fma, 1),
        "bf16_gflops": round(dot, 1),
        "bf16_native": has_dot,
        "int8_gops": round(int8, 1),
        "amx_int8_gops": None if amx is None else round(amx, 1),  # the int8 kernel's peak from 16 rows
        "amx_int8_all_cores_gops": None if amx_every_core is None else round(amx_every_core, 1),
        # the kernel's tile loop alone, one core, its weight in 1 MiB (as a group of panels in the second-level
        # cache) and in 4 MiB (past it): what the tiles can do where the weight lies
        "amx_int8_tile_loop_gops": tile_loop,
        "read_gb_s": round(read, 1),
        "read_all_cores_gb_s": round(every_core, 1),
        "cores": len(os.sched_getaffinity(0)),
    }


def tile_loop_rates(peak) -> dict[str, float]:
    """GOP/s of the W8A8 kernel's tile loop over a weight of 1 MiB and of 4 MiB, read in order again and again."""
    peak.amx_int8_stream.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    peak.amx_int8_stream.restype = ctypes.c_int64
    rates = {}
    for label, size in (("1 MiB", 1 << 20), ("4 MiB", 4 << 20)):
        weight = torch.ones(size, dtype=torch.int8)
        passes = (1 << 31) // size
        walk = functools.partial(peak.amx_int8_stream, weight.data_ptr(), size, passes)
        seconds = min(timed(walk) for _ in range(3))
        rates[label] = round(32 * size * passes / seconds / 1e9, 1)
    return rates


def read_in_parallel(peak, data: torch.Tensor) -> None:
    """`data` read by one thread per core, each its own share (ctypes lets go of the interpreter's lock)."""
    shares = data.chunk(len(os.sched_getaffinity(0)))
    run_together([threading.Thread(target=peak.read_all, args=(share.data_ptr(), share.nbytes)) for share in shares])


def on_every_core(function, *args) -> None:
    """`function(*args)` on one thread per core at once."""
    run_together([threading.Thread(target=function, args=args) for _ in os.sched_getaffinity(0)])


def run_together(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def tiles_from_16_rows() -> bool:
    build = int8_build()
    return build is not None and "AMX" in build.description


def cpu_features() -> list[str]:
    """The flags that choose a kernel build (kernels/native.py)."""
    wanted = {
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "avx_vnni",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
    }
    return sorted(native.cpu_flags() & wanted)
