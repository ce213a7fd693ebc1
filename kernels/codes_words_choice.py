"""Up to how many of a decode's rows 4-bit products run faster here as int16 words (AVX512-VNNI's byte dot product)
than by the bfloat16 dot product. The words cost a byte product a code for each row and quantizing the rows, the dot
product a bfloat16 product per two codes; CPUs with both retire the two at rates that differ several-fold, and not in
the same direction (docs/kernel-measurements.md), so the build times one product both ways on this core, at growing
row counts, and keeps the words up to the last count at which they took less time (`cpu_linear.time_code_words`).
"""

import statistics
import time
from collections.abc import Callable

ROUNDS = 9  # alternations of the two ways at each row count; the medians decide
CALLS = 8  # products a timing, each some tens of microseconds
ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # a decode's rows, up to the most the vector kernel takes as a decode


def rows_words_win(use_words: Callable[[bool], object], multiply: Callable[[int], bool]) -> int | None:
    """Time `multiply(rows)` (one product of that many rows; False where the kernel refused it) at each of
    ROW_COUNTS with the words on and off by `use_words` (alternating, on the calling thread), and answer the last
    count up to which the words took less time at every count: 0 where they lost at one row, None where they never
    lost or the kernel refused (no limit to set)."""
    won = 0
    for rows in ROW_COUNTS:
        spent: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ROUNDS):
            for words in (True, False):
                use_words(words)
                started = time.perf_counter()
                for _ in range(CALLS):
                    if not multiply(rows):
                        return None
                spent[words].append(time.perf_counter() - started)
        if statistics.median(spent[True]) >= statistics.median(spent[False]):
            return won
        won = rows
    return None
