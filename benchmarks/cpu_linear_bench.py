"""CPU linear layers against what the core can do: torch's own (its BLAS, or oneDNN) against the packed
kernels of `cpu_gemm.c` in float32, bfloat16 and float16, W8A8 int8 (`cpu_int8_gemm.c`, x quantized per row
as the worker does) and 4-bit codes by groups of 128 (W4A16, `gemm_codes`), one thread.

First a probe (`cpu_peaks.py`, running `cpu_peak.c` built for this CPU) measures the core's peak: float32
multiply-adds in its widest vectors, the bfloat16 dot product where the CPU has one (without it a bfloat16 weight is
widened and multiplied in float32, so float32's peak is its peak), int8 products as the W8A8 kernel makes them
(AVX512-VNNI's byte dot product, else int16 pairs; where the CPU has AMX tiles, also their int8 peak, which the int8
products from 16 rows are measured against, and the kernel's tile loop alone over a weight in the second-level
cache and past it, which bounds those products where their weight lies), and the rate at which one thread, and
every core at once, reads memory.
4-bit codes feed the bfloat16 dot product (or float32 multiply-adds): bfloat16's peak is theirs, though a decode's
few rows meet them in the byte dot product where the build has AVX512-VNNI, and more rows in AMX tiles where the CPU
has them, so their share of it can pass 100%.

Each product is timed as the worker calls it: into an output made beforehand, and for bfloat16 weights
from rows already in bfloat16 where the build takes them (the norm and activation kernels before a
projection write them so); torch's bfloat16 product likewise gets bfloat16 rows. W8A8's products take the int8
codes the norm or activation before them wrote, but for the o projection and the LM head, which quantize their
float32 rows themselves. A decode step's products (up to
DECODE_ROWS rows) are replayed from C, as the worker replays a decode step's kernel calls (kernels/replay.py),
with no Python between them; a prompt's are called from Python, as the worker calls them (the JSON keeps the rate
of a call from Python for every size too, `<layout>_call`).

Then weights of the 12-layer, 768-wide Llama of `ops/configs/llama-12l-768` (fused q/k/v and gate/up,
the down projection and the LM head) and of the shipped model's MLP, from one row (a decode at
concurrency 1) to 2,048 (a prefill): GFLOP/s (median over repeats) and, for the packed kernels, the
fraction of the dtype's peak. These weights stay in the third-level cache between repeats; a real step
reads every layer's weights from memory, so a second table times the linear layers of a whole 12-layer
step (replayed, as the worker replays a decode step), at 1 and 2 threads, with each layout's weights on huge
pages as the worker has them, and gives the rate at which they stream (GB/s) against the probe's. Writes
benchmarks/results/cpu_linear_bench.json.

    python benchmarks/cpu_linear_bench.py
    PAGEDSERVE_BENCH_ROWS=1,16 PAGEDSERVE_BENCH_REPEATS=3 python benchmarks/cpu_linear_bench.py   # shorter
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import platform
import statistics
import sys
import time
from itertools import zip_longest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.cpu_peaks import cpu_features, probe  # noqa: E402
from benchmarks.provenance import commit, cpu_model  # noqa: E402
from kernels import replay  # noqa: E402
from kernels.codes_words_choice import ROW_COUNTS  # noqa: E402
from kernels.cpu_int8_linear import (  # noqa: E402
    Int8Rows,
    int8_build,
    int8_linear,
    int8_rows_reference,
    pack_int8,
    rows_format,
)
from kernels.cpu_linear import (  # noqa: E402
    bf16_rows,
    code_words_rows,
    gemm,
    gemm_build,
    gemm_codes,
    pack,
    pack_codes,
    use_code_words,
)

REPEATS = int(os.environ.get("PAGEDSERVE_BENCH_REPEATS", "15"))
ROWS = [int(r) for r in os.environ.get("PAGEDSERVE_BENCH_ROWS", "1,4,16,48,256,2048").split(",")]
STEP_ROWS = [int(r) for r in os.environ.get("PAGEDSERVE_BENCH_STEP_ROWS", "1,4,16,48,256").split(",")]
THREADS = [int(t) for t in os.environ.get("PAGEDSERVE_BENCH_THREADS", "1,2").split(",")]
STEP_LAYERS = 12
DECODE_ROWS = 256  # the worker's decode steps replay their kernel calls up to --max-num-seqs rows (256 by default)
HUGE_PAGE = 2 << 20
WEIGHTS = {  # name: (out features, in features)
    "12-layer qkv": (1280, 768),
    "12-layer o": (768, 768),
    "12-layer gate_up": (4096, 768),
    "12-layer down": (768, 2048),
    "12-layer lm_head": (4096, 768),
    "shipped gate_up": (1408, 256),
    "shipped down": (256, 704),
}
LAYOUTS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "int8": torch.int8, "int4": torch.uint8}
GROUP = 128  # the W4A16 checkpoints' group of inputs
AMX_ROWS = 16  # the int8 kernel multiplies blocks of this many rows in AMX tiles where the CPU has them
PEAK_OF = {"f32": "f32_gflops", "f16": "f32_gflops", "bf16": "bf16_gflops", "int8": "int8_gops", "int4": "bf16_gflops"}


def median_s(run, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def packed(weight: torch.Tensor, layout: str):
    """`weight` as the layout's kernel takes it: float panels, int8 panels (per-channel codes), or 4-bit codes
    by groups with their scales and offsets."""
    if layout == "int8":
        return pack_int8(torch.randint(-128, 128, weight.shape, dtype=torch.int8))
    if layout == "int4":
        codes = torch.randint(0, 16, weight.shape, dtype=torch.uint8)
        scales = torch.rand(weight.shape[0], weight.shape[1] // GROUP) * 0.01
        return pack_codes(codes, scales, -8 * scales, "uint4")
    return pack(weight.to(LAYOUTS[layout]))


def product(layout: str):
    """The layout's call as the worker makes it, on x as `as_the_worker_gives` hands it, into `out`."""
    if layout == "int8":
        scales = {}

        def int8(x, p, n, out):
            if n not in scales:  # made once: a replay allocates nothing
                scales[n] = torch.ones(n)
            return int8_linear(x, p, scales[n], None, out=out)

        return int8
    if layout == "int4":
        return lambda x, p, n, out: gemm_codes(x, p, None, out, bf16_x=True)
    return lambda x, p, n, out: gemm(x, p, n, None, out=out)


def as_the_worker_gives(x: torch.Tensor, layout: str, name: str) -> torch.Tensor | Int8Rows:
    """`x` as the worker hands it to a `layout` product of the weight `name`: bfloat16 rows where the build takes
    them; for int8, the codes the norm or activation before it wrote, but for the o projection's rows (attention's
    output) and the LM head's, which the product quantizes itself."""
    if layout == "int8":
        takes_codes = not name.endswith((" o", " lm_head"))
        return int8_rows_reference(x, rows_format()) if takes_codes else x
    return bf16_rows(x).clone() if layout in ("bf16", "int4") and gemm_build().bf16_rows else x


def replayed_s(run, repeats: int = REPEATS, batch: int = 10) -> float | None:
    """The median time of `run`'s kernel calls replayed from C (kernels/replay.py), in batches of `batch` replays
    (a replay costs about a microsecond of its own); None where its calls cannot be replayed."""
    _, replayed, _ = replay.record(run)
    if replayed is None:
        return None
    return median_s(lambda: [replayed() for _ in range(batch)], repeats) / batch


def on_huge_pages(tensor: torch.Tensor, mappings: list[mmap.mmap]) -> torch.Tensor:
    """A copy of `tensor` in memory that asks the kernel for huge pages (where it has them on request)."""
    mapping = mmap.mmap(-1, tensor.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    mappings.append(mapping)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)


def huge(weight, mappings: list[mmap.mmap]):
    """A packed weight with its largest tensor (the panels or codes) on huge pages."""
    if isinstance(weight, torch.Tensor):
        return on_huge_pages(weight, mappings)
    return dataclasses.replace(weight, panels=on_huge_pages(weight.panels, mappings))


def nbytes(weight) -> int:
    """What a step reads of a packed weight: its panels, and a quantized one's scales (and offsets)."""
    if isinstance(weight, torch.Tensor):
        return weight.nbytes
    return sum(
        getattr(weight, name).nbytes for name in ("panels", "colsums", "scales", "offsets") if hasattr(weight, name)
    )


def peak_of(layout: str, rows: int, peaks: dict) -> float:
    """The peak of the instructions the layout's kernel uses at this many rows."""
    if layout == "int8" and rows >= AMX_ROWS and peaks["amx_int8_gops"]:
        return peaks["amx_int8_gops"]
    return peaks[PEAK_OF[layout]]


def per_weight(peaks: dict) -> list[dict]:
    amx = (
        f", in AMX tiles from {AMX_ROWS} rows {peaks['amx_int8_gops']} (every core at once "
        f"{peaks['amx_int8_all_cores_gops']}; the kernel's tile loop alone over a weight of "
        + ", of ".join(f"{size} {rate}" for size, rate in peaks["amx_int8_tile_loop_gops"].items())
        + ")"
        if peaks["amx_int8_gops"]
        else ""
    )
    print(
        f"\nGFLOP/s, one thread (% of the dtype's peak: float32 {peaks['f32_gflops']}, "
        f"bfloat16 {peaks['bf16_gflops']}, int8 {peaks['int8_gops']}{amx} GOP/s; 4-bit codes: bfloat16's)"
    )
    print(
        f"{'weight (out x in)':<30}{'rows':>5}{'torch f32':>10}{'torch bf16':>11}"
        + "".join(f"{'ours ' + name:>15}" for name in LAYOUTS)
    )
    rows_out = []
    for name, (out_features, in_features) in WEIGHTS.items():
        weight = torch.randn(out_features, in_features) * 0.02
        half = weight.to(torch.bfloat16)
        panels = {layout: packed(weight, layout) for layout in LAYOUTS}
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            x_half, out = x.to(torch.bfloat16), torch.empty(rows, out_features)
            flops = 2 * rows * out_features * in_features / 1e9
            repeats = REPEATS if rows < 256 else max(3, REPEATS // 5)
            row = {
                "weight": name,
                "out_features": out_features,
                "in_features": in_features,
                "rows": rows,
                "torch_f32": flops / median_s(lambda x=x, w=weight: F.linear(x, w), repeats),
                "torch_bf16": flops / median_s(lambda x=x_half, w=half: F.linear(x, w), max(1, repeats // 3)),
            }
            for layout, p in panels.items():
                given = as_the_worker_gives(x, layout, name)
                call = product(layout)

                def run(x=given, p=p, n=out_features, out=out, call=call):
                    return call(x, p, n, out)

                row[f"{layout}_call"] = flops / median_s(run, repeats)
                replayed = replayed_s(run, repeats) if rows <= DECODE_ROWS else None
                row[layout] = flops / replayed if replayed else row[f"{layout}_call"]
                row[f"{layout}_of_peak"] = row[layout] / peak_of(layout, rows, peaks)
            rows_out.append(
                {k: round(v, 3 if k.endswith("peak") else 1) if isinstance(v, float) else v for k, v in row.items()}
            )
            print(
                f"{name + f' ({out_features} x {in_features})':<30}{rows:>5}{row['torch_f32']:>10.1f}"
                f"{row['torch_bf16']:>11.1f}"
                + "".join(f"{row[layout]:>8.1f} ({row[layout + '_of_peak']:>3.0%})" for layout in LAYOUTS)
            )
    return rows_out


def whole_step(peaks: dict) -> list[dict]:
    """Milliseconds for the linear layers of one 12-layer step, each layout alternating, and the rate
    its weights stream at."""
    names = [f"12-layer {name}" for name in ("qkv", "o", "gate_up", "down")] * STEP_LAYERS + ["12-layer lm_head"]
    shapes = [WEIGHTS[name] for name in names]
    weights = [torch.randn(out_features, in_features) * 0.02 for out_features, in_features in shapes]
    mappings: list[mmap.mmap] = []
    panels = {layout: [huge(packed(w, layout), mappings) for w in weights] for layout in LAYOUTS}
    sizes = {layout: sum(nbytes(p) for p in ps) for layout, ps in panels.items()}
    rows_out = []
    print(
        f"\nlinear layers of a whole {STEP_LAYERS}-layer step (weights from memory, on huge pages), ms, "
        f"and the weights' rate in GB/s (one thread reads {peaks['read_gb_s']} GB/s, "
        f"{peaks['cores']} at once {peaks['read_all_cores_gb_s']})"
    )
    # a decode's 4-bit step both ways too, where the build has int16 words: "int4" is as the build chose here, up to
    # the rows at which the words were the faster when it loaded
    chosen = code_words_rows()
    ways = {"int4_words": True, "int4_dot": False} if use_code_words(True) else {}
    use_code_words(chosen)
    titles = {"int4_words": "int4 as int16", "int4_dot": "int4 by bf16 dot"}
    print(f"int4: int16 words up to {chosen} rows" if ways else "int4: no int16 words in this build")
    print(
        f"{'threads':>7}{'rows':>6}{'torch f32':>11}"
        + "".join(f"{name:>17}" for name in [*LAYOUTS, *(titles[key] for key in ways)])
    )
    for threads in THREADS:
        torch.set_num_threads(threads)
        for rows in STEP_ROWS:
            x = {width: torch.randn(rows, width) for _, width in shapes}
            outs = {n: torch.empty(rows, n) for n, _ in shapes}
            calls = {"torch_f32": lambda x=x: [F.linear(x[w.shape[1]], w) for w in weights]}
            by_python: list[str] = []  # layouts whose calls a recording refused: called from Python instead
            for layout, ps in panels.items():
                given = {name: as_the_worker_gives(x[WEIGHTS[name][1]], layout, name) for name in set(names)}
                call = product(layout)

                def step(x=given, ps=ps, outs=outs, call=call):
                    return [call(x[name], p, w.shape[0], outs[w.shape[0]]) for name, w, p in zip(names, weights, ps)]

                # a decode step's calls replayed from C, as the worker makes them; once before, so that what a
                # product makes on its first call (the int8 call's scales) is not made in the recording, which
                # would refuse it
                step()
                replayed = replay.record(step)[1] if rows <= DECODE_ROWS else None
                calls[layout] = replayed if replayed is not None else step
                by_python.extend([layout] if replayed is None and rows <= DECODE_ROWS else [])
            other = {key: words for key, words in ways.items() if rows <= ROW_COUNTS[-1]}  # a decode's rows
            for key, words in other.items():
                calls[key] = lambda int4=calls["int4"], words=words: (
                    use_code_words(words),
                    int4(),
                    use_code_words(chosen),
                )
            # no 4-bit call right after another (their weights nearly fit some CPUs' last-level cache, which would
            # flatter the second) nor after torch's (its threads spin on after its call, on the cores ours share)
            fours = ["int4", *other]
            first, *rest = [name for name in calls if name not in fours]
            order = [first] + [name for pair in zip_longest(rest, fours) for name in pair if name]
            times = {name: [] for name in calls}
            for _ in range(max(3, REPEATS // 3)):
                for name in order:
                    started = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - started)
            row = {
                "threads": threads,
                "rows": rows,
                **{f"{name}_ms": round(1e3 * statistics.median(t), 2) for name, t in times.items()},
                "called_from_python": by_python,
            }
            columns = [*LAYOUTS, *other]
            for layout in columns:
                size = sizes["int4" if layout in other else layout]
                row[f"{layout}_gb_s"] = round(size / row[f"{layout}_ms"] / 1e6, 1)
            rows_out.append(row)
            print(
                f"{threads:>7}{rows:>6}{row['torch_f32_ms']:>11.2f}"
                + "".join(f"{row[layout + '_ms']:>9.2f} ({row[layout + '_gb_s']:>4.1f})" for layout in columns)
            )
    torch.set_num_threads(1)
    return rows_out


def main() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    build = gemm_build()
    if build is None or int8_build() is None:
        sys.exit("no C compiler: the packed kernels cannot be built here")
    peaks = probe()
    print(
        f"kernels: {build.variant} ({build.description}); this core: float32 {peaks['f32_gflops']} GFLOP/s in "
        f"{peaks['vector_floats']}-float vectors, bfloat16 {peaks['bf16_gflops']} GFLOP/s "
        f"({'its dot product' if peaks['bf16_native'] else 'widened to float32'}), reads {peaks['read_gb_s']} GB/s "
        f"(every core at once: {peaks['read_all_cores_gb_s']})"
    )
    rows = per_weight(peaks)
    step = whole_step(peaks)
    out_dir = os.environ.get("PAGEDSERVE_BENCH_OUT", os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {cpu_model()}",
        "cpu_flags": cpu_features(),
        "kernels": f"{build.variant} ({build.description}); int8: {int8_build().description}",
        "threads": 1,
        "repeats": REPEATS,
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "unit": "GFLOP/s",
        "peak": peaks,
        "rows": rows,
        "whole_step": step,
    }
    with open(os.path.join(out_dir, "cpu_linear_bench.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
