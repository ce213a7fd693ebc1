"""docs/benchmarks.md's plots and tables, drawn from the JSON results under benchmarks/results/.

    python benchmarks/results_page.py           # draw the plots (needs matplotlib) and rewrite the tables
    python benchmarks/results_page.py --check   # fail when a plot or a table is stale (no matplotlib)

Each plot carries a digest of its inputs and of this script in a PNG text chunk; each table sits in the
page (docs/benchmarks.md, and the feature page it belongs to) between `<!-- results:NAME -->` and
`<!-- /results:NAME -->` and is written from the same inputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
# a table may sit on several pages
PAGES_WITH_TABLES = (
    PAGE,
    ROOT / "docs" / "features" / "quantization.md",
    ROOT / "docs" / "features" / "pooling-models.md",
)
IMAGES = ROOT / "docs" / "img" / "results"
DIGEST_KEY = "pagedserve-inputs"


@dataclass(frozen=True, slots=True)
class PeerRow:
    """One scenario of one peer_bench sitting, as a row of a comparison."""

    label: str
    file: str
    scenario: str


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    inputs: tuple[str, ...]
    draw: Callable[[dict[str, dict], Path], None] | None  # None: a table alone
    table: Callable[[dict[str, dict]], list[str]]


FLOAT_ROWS = (
    PeerRow("12-layer Llama, bf16, 16 streams", "peer_bench_12l_bf16_auto-bursts.json", "mid_c16"),
    PeerRow("12-layer Llama, bf16, 1 stream", "peer_bench_12l_bf16_auto-bursts.json", "mid_c1"),
    PeerRow("12-layer Llama, float32, 16 streams", "peer_bench_12l_f32.json", "mid_c16"),
    PeerRow("12-layer Llama, float32, 1 stream", "peer_bench_12l_f32.json", "mid_c1"),
    PeerRow("shipped model, bf16, 48 streams", "peer_bench_shipped_auto.json", "c48"),
    PeerRow("shipped model, float32, 48 streams", "peer_bench_shipped_f32.json", "c48"),
    PeerRow("sweep-1024-gqa8, bf16, 16 streams", "peer_bench_sweep-1024-gqa8-bf16.json", "mid_c16"),
    PeerRow("sweep-2048-gqa2, bf16, 16 streams", "peer_bench_sweep-2048-gqa2-bf16-bursts.json", "mid_c16"),
    PeerRow("sweep-1280-qwen3-hd80, bf16, 16 streams", "peer_bench_sweep-1280-qwen3-hd80-bf16-bursts.json", "mid_c16"),
    PeerRow("sweep-512-mha, float32, 16 streams", "peer_bench_sweep-512-mha-5reps.json", "mid_c16"),
    PeerRow("sweep-1536-gqa3, float32, 16 streams", "peer_bench_sweep-1536-gqa3.json", "mid_c16"),
)
QUANTIZED_FILES = (
    "llama-12l-w8a8",
    "sweep-1024-gqa8-w8a8",
    "sweep-2048-gqa2-w8a8",
    "llama-12l-w4a16",
    "sweep-1280-qwen3-w4a16",
    "sweep-1024-gqa8-w4a16-g64",
    "llama-12l-gptq",
)
# Scenarios measured again in a later sitting (after a kernel change), which replace the first sitting's rows.
QUANTIZED_LATER = {
    "llama-12l-w8a8": "llama-12l-w8a8-decode",
    "sweep-1024-gqa8-w8a8": "sweep-1024-gqa8-w8a8-decode",
    "sweep-2048-gqa2-w8a8": "sweep-2048-gqa2-w8a8-decode",
    "llama-12l-w4a16": "llama-12l-w4a16-one",
    "sweep-1280-qwen3-w4a16": "sweep-1280-qwen3-w4a16-one",
    "sweep-1024-gqa8-w4a16-g64": "sweep-1024-gqa8-w4a16-g64-one",
    "llama-12l-gptq": "llama-12l-gptq-one",
}
# Sittings on a CPU with AMX tiles (the table above is AVX-512 without them), in the order they were made.
AMX_QUANTIZED_FILES = (
    "llama-12l-w8a8",
    "sweep-1024-gqa8-w8a8-decode",
    "llama-12l-w4a16-one",
    "sweep-1280-qwen3-w4a16-one",
    "llama-12l-gptq-one",
    "llama-12l-w8a8-one-prefill",  # a later sitting: one stream, long prompts, and 16 streams again
    "sweep-1024-gqa8-w4a16-g64",
    "llama-12l-w8a8-amx-attention",  # prompt attention in AMX tiles from here on
    "sweep-1024-gqa8-w4a16-g64-amx-attention",
    "sweep-1024-gqa8-w4a16-g64-amx-codes",  # and a decode's 4-bit codes in AMX tiles
    "llama-12l-w4a16-amx-codes",
    "llama-12l-gptq-amx-codes",
    "llama-12l-w4a16-prompt-tiles",  # and a prompt's rows against codes in the codes kernel's own tiles
    "llama-12l-gptq-prompt-tiles",
    "sweep-2048-gqa2-w8a8-amx-attention",  # W8A8 on a sweep shape, every AMX path of its kind on
    "sweep-1280-qwen3-w4a16-prompt-tiles",
    "llama-12l-w4a16-prompt-tiles16",  # and those tiles 16 rows at a time
    "llama-12l-w8a8-chunk-rows",  # the int8 tiles' rows passing a chunk's panels, and quantizing in vectors
    "llama-12l-w8a8-norm-codes",  # and W8A8's rows quantized by the norms and the activation
    "llama-12l-w8a8-wide-chunks",  # and the int8 tiles' panels by groups, a prompt's chunks wider
    "llama-12l-w8a8-one-prefill-wide-chunks",
    "sweep-2048-gqa2-w8a8-wide-chunks",
    "llama-12l-w4a16-one-int16-rows",  # a decode's few rows against 4-bit codes as int16 values' bytes
    "llama-12l-w4a16-int16-rows",
    "sweep-2048-gqa2-w8a8-resat",  # W8A8 on the gqa2 shape again, its kernels as at the sitting before
    "llama-12l-w8a8-tile-ahead",
    "llama-12l-w8a8-decode-tile-ahead",
    "sweep-2048-gqa2-w8a8-tile-ahead",  # int8 tiles asking for the next panel while a decode's rows pass
    "llama-12l-w4a16-head-slices",  # one stream of a long context, a lone row's attention cut by KV heads
    "llama-12l-w8a8-head-slices",
)
# Sittings on a Zen 4 CPU (AVX-512 with VNNI and the bfloat16 dot product, no AMX), the issue's own machine.
ZEN4_QUANTIZED_FILES = (
    "llama-12l-w8a8",
    "llama-12l-w4a16",  # a decode's int16 words up to the rows they were timed faster, from here on
    "sweep-2048-gqa2-w8a8",
    "sweep-1280-qwen3-w4a16",
)
LATER_KERNELS = {  # a file's suffix: what its sitting ran anew
    "-amx-attention": "prompt attention in tiles",
    "-amx-codes": "attention and codes in tiles",
    "-prompt-tiles": "prompts' codes in the kernel's own tiles",
    "-prompt-tiles16": "prompts' codes in tiles 16 rows at a time",
    "-chunk-rows": "int8 rows across a chunk's panels",
    "-norm-codes": "int8 rows written by the norms and SiLU",
    "-wide-chunks": "and int8 panels by groups and wider chunks",
    "-int16-rows": "a decode's few rows as int16 against 4-bit codes",
    "-resat": "the same kernels sat again",
    "-tile-ahead": "int8 tiles asking for the next panel during a decode",
    "-head-slices": "a lone decode row's attention cut by KV heads",
}
SCENARIO_NAMES = {
    "mid_c16": "16 streams",
    "mid_c1": "1 stream",
    "long_c1": "1 stream, 1,536 in and 256 out",
    "decode_c32": "decode, 32 streams",
    "prefill_1k": "prefill 1,024",
    "c48": "48 streams",
}


def quantized_rows() -> tuple[PeerRow, ...]:
    rows = []
    for name in QUANTIZED_FILES:
        path = RESULTS / "quantized" / f"{name}.json"
        if not path.exists():
            continue
        later = RESULTS / "quantized" / f"{QUANTIZED_LATER.get(name, name)}.json"
        remeasured = json.loads(later.read_text())["scenarios"] if later != path and later.exists() else {}
        for scenario in json.loads(path.read_text())["scenarios"]:
            file = later if scenario in remeasured else path
            label = f"{name}, {SCENARIO_NAMES.get(scenario, scenario)}"
            rows.append(PeerRow(label, f"quantized/{file.name}", scenario))
    return tuple(rows)


def amx_quantized_rows() -> tuple[PeerRow, ...]:
    return sitting_rows("quantized-amx", AMX_QUANTIZED_FILES)


def zen4_quantized_rows() -> tuple[PeerRow, ...]:
    return sitting_rows("quantized-zen4", ZEN4_QUANTIZED_FILES)


def sitting_rows(folder: str, files: tuple[str, ...]) -> tuple[PeerRow, ...]:
    """Rows of a machine's sittings, in the order they were made, labelled by what each sat anew."""
    rows = []
    for name in files:
        path = RESULTS / folder / f"{name}.json"
        if path.exists():
            label, note = name, ""
            for suffix, kernels in LATER_KERNELS.items():
                if label.endswith(suffix):
                    label, note = label.removesuffix(suffix), f", {kernels}"
            label = label.removesuffix("-one-prefill").removesuffix("-one").removesuffix("-decode")
            for scenario in json.loads(path.read_text())["scenarios"]:
                workload = f"{label}, {SCENARIO_NAMES.get(scenario, scenario)}{note}"
                if any(row.label == workload for row in rows):
                    workload += ", a later sitting"
                rows.append(PeerRow(workload, f"{folder}/{path.name}", scenario))
    return tuple(rows)


def metric(sitting: dict, scenario: str, name: str) -> dict:
    for row in sitting["table"]:
        if row["scenario"] == scenario and row["metric"] == name:
            return row
    raise KeyError(f"{scenario} has no {name}")


def spread(values: list[float], digits: int = 1, unit: str = "") -> str:
    middle = f"{statistics.median(values):,.{digits}f}{unit}"
    if len(values) == 1:
        return middle
    return f"{middle} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def ratio_bars(axes, rows: tuple[PeerRow, ...], data: dict[str, dict], key: str, title: str) -> None:
    ratios = [metric(data[r.file], r.scenario, "output_throughput")[key] for r in rows]
    middles = [statistics.median(v) for v in ratios]
    errors = [[m - min(v) for m, v in zip(middles, ratios)], [max(v) - m for m, v in zip(middles, ratios)]]
    positions = list(range(len(rows)))[::-1]
    axes.barh(positions, middles, xerr=errors, color="#3b7dd8", capsize=3)
    axes.axvline(1.0, color="grey", linestyle=":")
    axes.set_yticks(positions, [r.label for r in rows], fontsize=8)
    axes.set_xlabel("output throughput ratio (median, range over repetitions)")
    axes.set_title(title, fontsize=10)


def peer_table(rows: tuple[PeerRow, ...], data: dict[str, dict], baseline: bool = False) -> list[str]:
    head = "| workload | pagedserve, tok/s | vLLM at its best | ratio | median TTFT, ours vs vLLM's |"
    rule = "| --- | --- | --- | --- | --- |"
    if baseline:
        head += " pagedserve bf16, tok/s | ratio | median TTFT, ours vs bf16 |"
        rule += " --- | --- | --- |"
    lines = [head, rule]
    for row in rows:
        sitting = data[row.file]
        throughput = metric(sitting, row.scenario, "output_throughput")
        ttft = metric(sitting, row.scenario, "median_ttft_ms")
        line = (
            f"| {row.label} | {spread(throughput['pagedserve'])} | {spread(throughput['vllm-best'])} "
            f"| **{spread(throughput['ratio_best'], 2, 'x')}** | {statistics.median(ttft['pagedserve']):,.0f} "
            f"vs {statistics.median(ttft['vllm-best']):,.0f} ms |"
        )
        if baseline and "baseline" not in throughput:
            line += " not in this sitting | | |"
        elif baseline:
            line += (
                f" {spread(throughput['baseline'])} | **{spread(throughput['ratio_baseline'], 2, 'x')}** "
                f"| {statistics.median(ttft['pagedserve']) / statistics.median(ttft['baseline']):.2f}x |"
            )
        lines.append(line)
    return lines + ["", provenance(data)]


def provenance(data: dict[str, dict]) -> str:
    """Where the figures came from: machines, dates, commits and files."""
    cpus = sorted({d.get("cpu") or "a 2-core x86_64 VM (CPU model not recorded)" for d in data.values()})
    dates = sorted({str(d.get("date", "?"))[:10] for d in data.values()})
    commits = sorted({str(d["commit"]).removesuffix("-dirty") for d in data.values() if "commit" in d})
    files = ", ".join(f"`{name}`" for name in data)
    at = f", at {', '.join(commits)}" if commits else ""
    return f"Measured on {'; '.join(cpus)}, {', '.join(dates)}{at}. Files (in `benchmarks/results/`): {files}."


def draw_float(data: dict[str, dict], path: Path) -> None:
    from benchmarks.paper_harness import pyplot, save_figure

    figure, axes = pyplot().subplots(figsize=(8, 4.5))
    ratio_bars(axes, FLOAT_ROWS, data, "ratio_best", "pagedserve over vLLM's CPU build at its best, same dtype")
    save_figure(figure, path)


def draw_quantized(data: dict[str, dict], path: Path) -> None:
    from benchmarks.paper_harness import pyplot, save_figure

    rows = quantized_rows()
    figure, (left, right) = pyplot().subplots(1, 2, figsize=(11, 0.32 * len(rows) + 1.5), sharey=True)
    ratio_bars(left, rows, data, "ratio_best", "over vLLM at its best, same checkpoint")
    ratio_bars(right, rows, data, "ratio_baseline", "over pagedserve on the bf16 checkpoint")
    save_figure(figure, path)


def draw_memory(data: dict[str, dict], path: Path) -> None:
    from benchmarks.fig2_memory_breakdown import plot

    plot(data["archive/fig2_memory_breakdown.json"]["breakdown_percent"], path)


def memory_table(data: dict[str, dict]) -> list[str]:
    from_labels = {"paged": "pagedserve", "oracle": "Orca (Oracle)", "pow2": "Orca (Pow2)", "max": "Orca (Max)"}
    breakdown = data["archive/fig2_memory_breakdown.json"]["breakdown_percent"]
    lines = [
        "| system | token states | reserved | internal fragmentation | external fragmentation | req/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for policy, shares in breakdown.items():
        lines.append(
            f"| {from_labels[policy]} | {shares['tokens']:.1f}% | {shares['reserved']:.1f}% "
            f"| {shares['unused']:.1f}% | {shares['fragmented']:.1f}% | {shares['request_throughput']:.2f} |"
        )
    return lines + ["", provenance(data)]


def draw_rate(workload_file: str, title: str) -> Callable[[dict[str, dict], Path], None]:
    def draw(data: dict[str, dict], path: Path) -> None:
        from benchmarks.fig12_latency_vs_rate import plot

        sitting = data[workload_file]
        plot(sitting["runs"], sitting["slo_s_per_token"], title, path)

    return draw


def rate_table(data: dict[str, dict]) -> list[str]:
    lines = [
        "| system | ShareGPT-like: sustained req/s | pagedserve's over it | Alpaca-like | pagedserve's over it |",
        "| --- | --- | --- | --- | --- |",
    ]
    names = {"paged": "pagedserve", "oracle": "Orca (Oracle)", "pow2": "Orca (Pow2)", "max": "Orca (Max)"}
    for policy, name in names.items():
        cells = []
        for sitting in (data["archive/fig12_sharegpt_2k.json"], data["archive/fig12_alpaca.json"]):
            rate, ours = sitting["sustained_rate"][policy], sitting["sustained_rate"]["paged"]
            never_crossed = rate >= max(point["rate"] for point in sitting["runs"][policy])
            cells.append(f"≥ {rate:.2f} (never over the limit)" if never_crossed else f"{rate:.2f}")
            cells.append("–" if never_crossed or policy == "paged" else f"{ours / rate:.2f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    hf = data["archive/hf_static_batching.json"]
    lines += [
        "",
        f"Against HF transformers' `generate` in static batches of {hf['args']['batch_size']} on the "
        f"same ShareGPT-like trace: {hf['pagedserve_output_tok_s']:.0f} against "
        f"{hf['hf_generate_output_tok_s']:.0f} output tok/s, **{hf['ratio']:.1f}x**.",
        "",
    ]
    return lines + [provenance(data)]


def draw_sharing(data: dict[str, dict], path: Path) -> None:
    from benchmarks.sharing_bench import plot

    plot(data["archive/sharing_bench.json"]["rows"], str(path))


def sharing_table(data: dict[str, dict]) -> list[str]:
    paper = {("parallel", 2): "6.1%", ("parallel", 6): "9.8%", ("beam", 2): "37.6%", ("beam", 6): "55.2%"}
    lines = ["| sharing | width | KV blocks saved | the paper's |", "| --- | --- | --- | --- |"]
    for row in data["archive/sharing_bench.json"]["rows"]:
        mode = "parallel sampling" if row["mode"] == "parallel" else "beam search"
        lines.append(
            f"| {mode} | {row['width']} | {row['saving_percent']:.1f}% | {paper.get((row['mode'], row['width']), '')} |"
        )
    return lines + ["", provenance(data)]


def draw_prefix(data: dict[str, dict], path: Path) -> None:
    from benchmarks.fig16_shared_prefix import plot

    plot(data["archive/fig16_shared_prefix.json"]["results"], path)


def prefix_table(data: dict[str, dict]) -> list[str]:
    results = data["archive/fig16_shared_prefix.json"]["results"]
    systems = list(next(iter(results.values())))
    lines = ["| prefix | " + " | ".join(f"{s}, req/s" for s in systems) + " |", "| --- |" + " --- |" * len(systems)]
    for workload, by_system in results.items():
        shots = {"prefix1": "one-shot (80 tokens)", "prefix5": "five-shot (341 tokens)"}.get(workload, workload)
        lines.append(f"| {shots} | " + " | ".join(f"{by_system[s]['request_throughput']:.1f}" for s in systems) + " |")
    return lines + ["", provenance(data)]


def quality_table(data: dict[str, dict]) -> list[str]:
    record = data["quantized_quality.json"]
    base = record["perplexity"]["bf16 (as shipped)"]
    lines = ["| checkpoint | perplexity | against bf16 |", "| --- | --- | --- |"]
    for name, value in record["perplexity"].items():
        lines.append(f"| {name} | {value:.3f} | {value / base - 1:+.1%} |")
    return lines + [
        "",
        f"{record['files']} files, their first {record['tokens_per_file']} tokens each. " + provenance(data),
    ]


EMBEDDING_FILES = ("embeddings/llama-12l-768-bf16.json",)


def embeddings_table(data: dict[str, dict]) -> list[str]:
    """benchmarks/embed_bench.py's sittings: embeddings per second, pagedserve against vLLM at its best."""
    lines = ["| model, workload | pagedserve, embeddings/s | vLLM at its best | ratio |", "| --- | --- | --- | --- |"]
    for name in EMBEDDING_FILES:
        record = data[name]
        runs = record["runs"]
        for workload, shape in record["workloads"].items():
            ours = [run[workload]["embeddings_per_s"] for run in runs["pagedserve"]]
            peers = [runs[s] for s in ("vllm", "vllm-all-cores")]
            best = [max(peer[i][workload]["embeddings_per_s"] for peer in peers) for i in range(len(ours))]
            label = (
                f"{Path(record['model']).name}, {shape['inputs']} inputs of {shape['tokens']} tokens, "
                f"{shape['batch']} a request, {shape['concurrency']} at once"
            )
            ratios = [a / b for a, b in zip(ours, best)]
            lines.append(f"| {label} | {spread(ours)} | {spread(best)} | **{spread(ratios, 2, 'x')}** |")
    return lines + ["", provenance(data)]


SECTIONS = (
    Section(
        "peer-float",
        tuple(dict.fromkeys(r.file for r in FLOAT_ROWS)),
        draw_float,
        lambda data: peer_table(FLOAT_ROWS, data),
    ),
    Section(
        "peer-quantized",
        tuple(dict.fromkeys(r.file for r in quantized_rows())),
        draw_quantized,
        lambda data: peer_table(quantized_rows(), data, baseline=True),
    ),
    Section(
        "peer-quantized-amx",
        tuple(dict.fromkeys(r.file for r in amx_quantized_rows())),
        None,
        lambda data: peer_table(amx_quantized_rows(), data, baseline=True),
    ),
    Section(
        "peer-quantized-zen4",
        tuple(dict.fromkeys(r.file for r in zen4_quantized_rows())),
        None,
        lambda data: peer_table(zen4_quantized_rows(), data, baseline=True),
    ),
    Section("quantized-quality", ("quantized_quality.json",), None, quality_table),
    Section("peer-embeddings", EMBEDDING_FILES, None, embeddings_table),
    Section("paper-memory", ("archive/fig2_memory_breakdown.json",), draw_memory, memory_table),
    Section(
        "paper-rate-sharegpt",
        ("archive/fig12_sharegpt_2k.json", "archive/fig12_alpaca.json", "archive/hf_static_batching.json"),
        draw_rate("archive/fig12_sharegpt_2k.json", "ShareGPT-like trace, context 2,048"),
        rate_table,
    ),
    Section(
        "paper-rate-alpaca",
        ("archive/fig12_alpaca.json",),
        draw_rate("archive/fig12_alpaca.json", "Alpaca-like trace"),
        lambda data: [],
    ),
    Section("paper-sharing", ("archive/sharing_bench.json",), draw_sharing, sharing_table),
    Section("paper-prefix", ("archive/fig16_shared_prefix.json",), draw_prefix, prefix_table),
)


def load(section: Section) -> dict[str, dict]:
    return {name: json.loads((RESULTS / name).read_text()) for name in section.inputs}


def digest(section: Section) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for name in section.inputs:
        h.update(name.encode())
        h.update((RESULTS / name).read_bytes())
    return h.hexdigest()


def png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file."""
    data = path.read_bytes()
    texts, at = {}, 8
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at : at + 4]), data[at + 4 : at + 8]
        if kind == b"tEXt":
            key, _, value = data[at + 8 : at + 8 + length].partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + length
    return texts


def add_png_text(path: Path, key: str, value: str) -> None:
    data = path.read_bytes()
    body = b"tEXt" + key.encode("latin-1") + b"\0" + value.encode("latin-1")
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    end = data.rindex(b"IEND") - 4
    path.write_bytes(data[:end] + chunk + data[end:])


def tables_in(page: str, sections: tuple[Section, ...]) -> str:
    """The page with every section's table written afresh between its markers."""
    for section in sections:
        start, stop = f"<!-- results:{section.name} -->", f"<!-- /results:{section.name} -->"
        if start not in page:
            continue
        head, rest = page.split(start, 1)
        _, tail = rest.split(stop, 1)
        body = "\n".join(section.table(load(section)))
        page = head + start + ("\n" + body + "\n" if body else "\n") + stop + tail
    return page


def stale() -> list[str]:
    problems = []
    for section in SECTIONS:
        image = IMAGES / f"{section.name}.png"
        if section.draw is None:
            continue
        if not image.exists():
            problems.append(f"{image.relative_to(ROOT)} is missing")
        elif png_text(image).get(DIGEST_KEY) != digest(section):
            problems.append(f"{image.relative_to(ROOT)} was drawn from other inputs")
    for path in PAGES_WITH_TABLES:
        page = path.read_text()
        if tables_in(page, SECTIONS) != page:
            problems.append(f"{path.relative_to(ROOT)}'s tables differ from their inputs")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only say whether the plots and tables are fresh")
    args = parser.parse_args()
    if args.check:
        problems = stale()
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            sys.exit("run python benchmarks/results_page.py to draw them again")
        print("the results page's plots and tables are fresh")
        return
    sys.path.insert(0, str(ROOT))
    for section in SECTIONS:
        if section.draw is None:
            continue
        image = IMAGES / f"{section.name}.png"
        section.draw(load(section), image)
        add_png_text(image, DIGEST_KEY, digest(section))
    for path in PAGES_WITH_TABLES:
        path.write_text(tables_in(path.read_text(), SECTIONS))


if __name__ == "__main__":
    main()
