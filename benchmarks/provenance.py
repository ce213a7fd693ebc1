"""Where a figure comes from: the CPU model and the commit every results file records."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")  # what decides the kernels


def cpu_model() -> str:
    """The model name, with family and model where it is as vague as "AMD EPYC" (a VM's), and the vector
    instructions that choose the kernels on both sides: "AMD EPYC (family 25 model 17; avx2 avx512f ...)"."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's fields
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    present = " ".join(flag for flag in VECTOR_FLAGS if flag in flags) or "no AVX2"
    return (
        f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family', '?')} "
        f"model {fields.get('model', '?')}; {present})"
    )


def commit() -> str:
    """The short commit, marked `-dirty` when the tree differs from it (the figure is then not that commit's); the
    results a sitting writes as it goes are no difference."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")
