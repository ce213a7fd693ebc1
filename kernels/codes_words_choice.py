"""Up to how many of a decode's rows 4-bit products run faster here as int16 words (AVX512-VNNI's byte dot product)
than by the bfloat16 dot product. The words cost a byte product a code for each row and quantizing the rows, the dot
product a bfloat16 product per two codes; CPUs with both retire the two at rates that differ several-fold, and not in
the same direction (docs/kernel-measurements.md), so the build times one product both ways on this core, at growing
row counts, and keeps the words up to the last count at which they took less time.
"""

import statistics
import time

import torch

ROUNDS = 9  # alternations of the two ways at each row count; the medians decide
CALLS = 8  # products a timing, each some tens of microseconds
ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # a decode's rows, up to the most the vector kernel takes as a decode
IN_FEATURES = 1024
GROUP = 128
PANELS = 8  # of the build's panel width: a weight that stays in the second-level cache, one thread's product


def rows_words_win(build) -> int:
    """Time a weight's product at each of ROW_COUNTS as int16 words and by the bfloat16 dot product (alternating, on
    the calling thread) and answer the last count up to which the words took less time at every count (0 where they
    lost at one row, every row where they never lost). Leaves the switch as it found it."""
    from kernels import cpu_linear

    kept = cpu_linear.code_words_rows(build)
    generator = torch.Generator().manual_seed(0)
    out_features = PANELS * build.panel_width
    codes = torch.randint(0, 16, (out_features, IN_FEATURES), generator=generator, dtype=torch.uint8)
    scales = torch.rand(out_features, IN_FEATURES // GROUP, generator=generator) * 0.01
    packed = cpu_linear.pack_codes(codes, scales, -8 * scales, "uint4", build)
    won = 0
    try:
        with torch.no_grad():
            for rows in ROW_COUNTS:
                x = torch.randn(rows, IN_FEATURES, generator=generator).bfloat16()
                out = torch.empty(rows, out_features)
                spent: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(ROUNDS):
                    for words in (True, False):
                        cpu_linear.use_code_words(words, build)
                        started = time.perf_counter()
                        for _ in range(CALLS):
                            if cpu_linear.gemm_codes(x, packed, None, out, build=build) is None:
                                return kept
                        spent[words].append(time.perf_counter() - started)
                if statistics.median(spent[True]) >= statistics.median(spent[False]):
                    return won
                won = rows
    finally:
        cpu_linear.use_code_words(kept, build)
    return cpu_linear.ALL_ROWS
