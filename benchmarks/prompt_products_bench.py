"""Who should multiply a prompt's rows on a CPU with AMX tiles: each weight type's product by the packed kernels'
vector instructions against the tiles, on every core, as the worker's `Linear` layers call them.

For a model config's projections (fused q/k/v, o, fused gate/up, down) at prompt-sized row counts it times a
bfloat16 weight and 4-bit codes by groups of 128 (W4A16) under `--prompt-products native` and `onednn`
(kernels/choice.py: oneDNN through torch, in AMX tiles), codes also in the codes kernel's own tiles (each panel
unpacked once, `cpu_linear.use_code_tiles`), and W8A8 int8 in its own kernel without and with AMX tiles
(`cpu_int8_linear.use_tiles`), and prints the sum over the projections (one layer's products) per route, with
the ratios. The routes alternate within each repetition, as this VM's speed drifts. Rows of x come as the
model gives them: bfloat16 where the layer takes bfloat16 rows. Writes benchmarks/results/prompt_products_bench.json.

    python benchmarks/prompt_products_bench.py ops/configs/sweep-1280-qwen3-hd80-bf16 ops/configs/llama-12l-768
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.provenance import commit, cpu_model  # noqa: E402
from kernels import choice, cpu_int8_linear, cpu_linear, native  # noqa: E402
from services.worker.models.linear import Linear  # noqa: E402
from services.worker.quantization.methods import CodedMethod, Int8Method  # noqa: E402
from services.worker.quantization.weights import CodedWeight, Int8Weight  # noqa: E402

ROWS = (64, 256, 1024, 2048)
KINDS = ("bf16", "w4a16", "w8a8")


def projections(config_dir: str) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's products, projections of one input fused as the worker fuses them."""
    c = json.loads((Path(config_dir) / "config.json").read_text())
    hidden, heads, kv = (
        c["hidden_size"],
        c["num_attention_heads"],
        c.get("num_key_value_heads", c["num_attention_heads"]),
    )
    head_dim = c.get("head_dim") or hidden // heads
    inter = c["intermediate_size"]
    return [((heads + 2 * kv) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]


def layer_of(kind: str, n: int, k: int) -> Linear:
    generator = torch.Generator().manual_seed(n * 7 + k)
    layer = Linear(k, n, bias=False)
    if kind == "bf16":
        layer = layer.to(torch.bfloat16)
    elif kind == "w4a16":
        group = 128 if k % 128 == 0 else 64
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
        scales = torch.rand(n, k // group, generator=generator) * 0.01
        layer.use(CodedMethod(CodedWeight(codes, scales, -8 * scales, "uint4")))
    else:
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        layer.use(Int8Method(Int8Weight(weight, torch.rand(n, generator=generator) * 0.01)))
    layer.prepare(torch.bfloat16)
    return layer


@contextlib.contextmanager
def route(kind: str, name: str):
    """native: the vector kernels; tiles: oneDNN's (bf16, w4a16) or the int8 kernel's (w8a8); codes_tiles: the
    codes kernel's own."""
    if kind == "w8a8":
        cpu_int8_linear.use_tiles(name == "tiles")
        yield
        return
    cpu_linear.use_code_tiles(name == "codes_tiles")
    with choice.chosen(prompt_products="onednn" if name == "tiles" else "native"):
        yield


def routes(kind: str) -> tuple[str, ...]:
    return (
        ("native", "tiles", "codes_tiles")
        if kind == "w4a16" and cpu_linear.use_code_tiles(True)
        else ("native", "tiles")
    )


def seconds(kind: str, layers: list[Linear], xs: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """The median time of one layer's products per route, the routes taking turns."""
    times: dict[str, list[float]] = {name: [] for name in routes(kind)}
    for repeat in range(repeats + 1):
        for name, kept in times.items():
            with route(kind, name):
                start = time.perf_counter()
                for layer, x in zip(layers, xs):
                    layer(x)
                if repeat:  # the first, a warm-up
                    kept.append(time.perf_counter() - start)
    return {name: statistics.median(kept) for name, kept in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "prompt_products_bench.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(f"{cpu_model()}, {native.threads()} kernel threads")
    results = []
    for config in args.configs:
        shapes = projections(config)
        for kind in KINDS:
            layers = [layer_of(kind, n, k) for n, k in shapes]
            for rows in ROWS:
                xs = [torch.randn(rows, k) for _, k in shapes]
                xs = [x.bfloat16() if layer.takes_bf16_rows else x for x, layer in zip(xs, layers)]
                by_route = seconds(kind, layers, xs, args.repeats)
                macs = sum(n * k for n, k in shapes) * rows
                row = {"config": Path(config).name, "kind": kind, "rows": rows, **by_route, "macs": macs}
                results.append(row)
                own = (
                    f", codes' own tiles {by_route['codes_tiles'] * 1e3:8.2f} ms "
                    f"({by_route['tiles'] / by_route['codes_tiles']:.2f}x oneDNN's)"
                    if "codes_tiles" in by_route
                    else ""
                )
                print(
                    f"{Path(config).name:28} {kind:6} {rows:5} rows: vectors {by_route['native'] * 1e3:8.2f} ms, "
                    f"tiles {by_route['tiles'] * 1e3:8.2f} ms ({by_route['native'] / by_route['tiles']:.2f}x), "
                    f"{2 * macs / by_route['tiles'] / 1e12:.2f} T(FL)OP/s in tiles{own}"
                )
    cpu_int8_linear.use_tiles(True)
    cpu_linear.use_code_tiles(True)
    record = {"cpu": cpu_model(), "commit": commit(), "date": time.strftime("%Y-%m-%d"), "rows": results}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
