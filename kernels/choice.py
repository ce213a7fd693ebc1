"""Which kernels run, chosen once per process from the worker's typed config (`--kernels`, `--cpu-kernels`,
`--prompt-products` in shared/config.py) before any kernel loads, and read by the dispatch. Tests change it
within `chosen(...)`.

backend: "auto" (Triton on CUDA, the compiled C kernels on a CPU, torch where they do not build), "reference"
(the per-sequence torch references on any device: the oracle the others are tested against), "torch" (a CPU
in torch, no compiler needed) or "triton" (Triton everywhere; on a CPU under TRITON_INTERPRET=1).
cpu_build: a build of kernels/native.py's VARIANTS (or the tests' EMULATED) that every compiled kernel is
loaded from; None: the best this CPU runs.
prompt_products: who multiplies a prompt's rows (cpu_linear.PROMPT_ROWS or more) of bfloat16 weights (and of codes
unpacked to bfloat16): "onednn" (torch's products, which use AMX tiles), "native" (the packed kernels), or
"auto": oneDNN where the CPU has AMX tiles for bfloat16, except for codes, whose kernel uses the tiles itself
(as W8A8's uses AMX tiles for int8).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from kernels import native

BACKENDS = ("auto", "reference", "torch", "triton")
PROMPT_PRODUCTS = ("auto", "onednn", "native")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    backend: str = "auto"
    cpu_build: str | None = None
    prompt_products: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kernels {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.prompt_products not in PROMPT_PRODUCTS:
            raise ValueError(f"prompt products {self.prompt_products!r}: expected one of {', '.join(PROMPT_PRODUCTS)}")
        if self.cpu_build is not None and self.cpu_build not in {**native.VARIANTS, **native.EMULATED}:
            raise ValueError(
                f"CPU kernels {self.cpu_build!r}: expected one of {', '.join([*native.VARIANTS, *native.EMULATED])}"
            )


_current = KernelChoice()


def current() -> KernelChoice:
    return _current


def choose(choice: KernelChoice) -> None:
    """This process's kernels from now on (a worker's, as it starts)."""
    global _current
    _current = choice
    native.forced_build = choice.cpu_build


@contextlib.contextmanager
def chosen(**changes: object) -> Iterator[KernelChoice]:
    """Within, the current choice with `changes` (tests)."""
    kept = _current
    choose(dataclasses.replace(kept, **changes))  # type: ignore[arg-type]
    try:
        yield _current
    finally:
        choose(kept)
