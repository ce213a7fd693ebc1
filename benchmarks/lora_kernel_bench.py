"""The Triton LoRA kernel on a GPU against the unbatched loop (one pair of torch products per adapter).

Llama-3-8B's q/k/v group (4,096 in; 4,096, 1,024, 1,024 out), float16, adapters of rank 16 on all three,
decoding rows spread round-robin over 4 or 16 adapters, each adapter's pages scattered over a pool of
16-token blocks. The loop reads each adapter from a contiguous copy (as it would after a gather), so it
is timed at its best. Needs CUDA. Prints a table and writes benchmarks/results/lora_kernel_bench.json.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.kernel_bench import time_ms  # noqa: E402
from kernels.lora_triton import FIELDS, lora_add_triton  # noqa: E402
from shared.lora import page_layout  # noqa: E402

GROUP = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024)}
RANK, DTYPE, HALF = 16, torch.float16, 16 * 8 * 128  # one layer's keys in a block: 16 tokens, 8 heads, 128


def case(adapters: int, rows: int, device: str = "cuda", timing: bool = True, group: dict = GROUP) -> dict:
    """`group`: each projection's (inputs, outputs), side by side in the output in this order."""
    count, parts = page_layout(RANK, tuple(group), group, HALF)
    columns = dict(zip(group, [0, *itertools.accumulate(size_out for _, size_out in group.values())]))
    blocks = adapters * count + 64
    pool = torch.zeros((2 * blocks, HALF), dtype=DTYPE, device=device)
    order = torch.randperm(blocks).tolist()
    table = torch.zeros((adapters, FIELDS), dtype=torch.int64)
    page_table = torch.zeros((adapters, 2 * count), dtype=torch.int64)
    contiguous = []
    for index in range(adapters):
        pages = torch.tensor(order[index * count : (index + 1) * count])
        page_table[index] = torch.cat([pages, pages + blocks])
        row = [RANK, len(group)]
        matrices = {}
        for projection, (_, size_out) in group.items():
            a, b = parts[projection, "A"], parts[projection, "B"]
            starts = [part.region * count * HALF + part.offset for part in (a, b)]
            for start, part in zip(starts, (a, b)):
                values = (torch.randn(part.rows * part.cols, device=device) / 64).to(DTYPE)
                at = start + torch.arange(values.numel(), device=device)
                pool[page_table[index].to(device)[at // HALF], at % HALF] = values
                matrices[projection, part is a] = values.view(part.rows, part.cols)
            row += [*starts, columns[projection], size_out]
        table[index] = torch.tensor(row)
        contiguous.append(matrices)
    units = torch.tensor([(r, r % adapters) for r in range(rows)], dtype=torch.int64, device=device)
    width_in = next(iter(group.values()))[0]
    widest = max(size_out for _, size_out in group.values())
    x = torch.randn(rows, width_in, dtype=DTYPE, device=device)
    out = torch.zeros(rows, sum(size_out for _, size_out in group.values()), dtype=DTYPE, device=device)
    table, page_table = table.to(device), page_table.to(device)

    def kernel():
        lora_add_triton(x, out, units, table, page_table, pool.view(-1), 0, HALF, RANK, widest)

    groups = [torch.arange(index, rows, adapters, device=device) for index in range(min(adapters, rows))]

    def loop():
        for index, members in enumerate(groups):
            if not len(members):
                continue
            for projection in group:
                a, b = contiguous[index][projection, True], contiguous[index][projection, False]
                first = columns[projection]
                out[members, first : first + b.shape[1]] += (x[members] @ a.t()) @ b

    check = out.clone()
    out.zero_()
    kernel()
    got = out.clone()
    out.zero_()
    loop()
    torch.testing.assert_close(got, out, atol=2e-2, rtol=2e-2)
    out.copy_(check)
    if not timing:
        return {}
    kernel_ms, loop_ms = time_ms(kernel, 50), time_ms(loop, 50)
    return {
        "adapters": adapters,
        "rows": rows,
        "kernel_ms": round(kernel_ms, 4),
        "loop_ms": round(loop_ms, 4),
        "speedup": round(loop_ms / kernel_ms, 2),
    }


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("lora_kernel_bench needs CUDA")
    results = [case(adapters, rows) for adapters in (4, 16) for rows in (4, 16, 64)]
    print(f"{torch.cuda.get_device_name()}: q/k/v of an 8B model, rank {RANK}, float16")
    print("adapters  rows  kernel ms  loop ms  loop/kernel")
    for r in results:
        print(
            f"{r['adapters']:>8}  {r['rows']:>4}  {r['kernel_ms']:>9.4f}  {r['loop_ms']:>7.4f}  {r['speedup']:>10.2f}"
        )
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "lora_kernel_bench.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
