"""Paged attention for the CPU.

`paged_attention_native` runs the C kernel of `cpu_attention.c` over the whole step (float32
queries, a cache of float32, a half type, int8 or E4M3), its sequences in chunks of about equal
work that the threads sharing the call claim in turn (`native.share`). Where it cannot be compiled,
`paged_attention_torch` serves a whole step in a few vectorized calls per layer: decode sequences (one
query each) go together: their blocks are gathered into one padded
`[seqs, context, kv_heads, head_dim]` workspace with `index_select`, and a single masked
`scaled_dot_product_attention` (grouped-query aware) serves them all. Sequences with several
queries (prompt chunks) are few per step and go one call each, causal where the chunk is the
whole context. Both keep the contract of `paged_attention_reference`, which stays the oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native
from kernels.batch import PagedBatch
from kernels.kv_quant import SCALE_BYTES
from kernels.workspace import Workspace, step_scratch

CHUNK_BYTES = 4 << 20  # gathered keys and values per attention call
QUERY_BLOCK = 8  # queries of a sequence the compiled kernel serves together (cpu_attention.c)
BLOCK_HEADS, KEY_PAD = 2, 32  # cpu_attention.c's prompt blocks: heads scored together, positions past the context
CHUNKS_PER_THREAD = 4  # a shared call's sequences come in this many chunks per thread, claimed in turn


def paged_attention_cpu(
    query, key_cache, value_cache, batch: PagedBatch, scale: float, window: int | None = None
) -> torch.Tensor:
    if native_accepts(query, key_cache, value_cache):
        return paged_attention_native(query, key_cache, value_cache, batch, scale, window)
    return paged_attention_torch(query, key_cache, value_cache, batch, scale, window)


@functools.cache
def native_kernel(symbol: str = "paged_attention_f32", variant: str | None = None):
    """The C kernel over a float32 cache, or with "paged_attention_bf16" (or "_f16", "_i8", "_f8") over a
    bfloat16 (or float16, int8, E4M3) one; the build that runs here, or `variant`'s."""
    p, i = native.POINTER, native.INT64
    kernel = native.function(
        "cpu_attention",
        symbol,
        [p, i, p, p, p, i, p, p, p, i, p, i, i, i, i, i, native.FLOAT, i, i, p, p],
        None,
        variant=variant,
    )
    if kernel is not None:
        _tiles_at_load(variant)
    return kernel


def _switch_tiles(on: bool, variant: str | None) -> bool:
    switch = native.function("cpu_attention", "attention_use_amx", [native.INT64], native.INT64, variant=variant)
    return switch is not None and bool(switch(int(on and native.cpu_flags() >= native.AMX_BF16)))


@functools.cache
def _tiles_at_load(variant: str | None) -> bool:
    return _switch_tiles(True, variant)


def use_tiles(on: bool, variant: str | None = None) -> bool:
    """Whether the build (the one that runs here, or `variant`'s) takes a prompt's blocks over a bfloat16 cache in
    AMX tiles from now on: where asked, the build has the bfloat16 dot product, the CPU has the tiles and Linux
    lets this process use them. The same arithmetic as the dot product's, summed in another order. The tests
    compare both ways; a worker keeps what the build chose as it loaded."""
    _tiles_at_load(variant)  # else a first load after this call would switch them on again
    return _switch_tiles(on, variant)


def bf16_dot(variant: str | None = None) -> bool:
    """Whether the build serves rows over a bfloat16 cache by the bfloat16 dot product: their query and softmax
    weights are then rounded to bfloat16, as a bfloat16 model's attention holds them."""
    fact = native.function("cpu_attention", "paged_attention_bf16_dot", [], native.INT64, variant=variant)
    return fact is not None and bool(fact())


MAX_DECODED, TILE = 16384, 16  # cpu_attention.c decodes a tile of TILE cached tokens' rows into this many floats
SYMBOLS = {
    torch.float32: "paged_attention_f32",
    torch.bfloat16: "paged_attention_bf16",
    torch.float16: "paged_attention_f16",
    torch.int8: "paged_attention_i8",
    torch.uint8: "paged_attention_f8",
}  # uint8: E4M3 rows (kernels/kv_quant.py)


def _symbol(key_cache: torch.Tensor) -> str:
    return SYMBOLS[key_cache.dtype]


def native_accepts(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    if key_cache.dtype not in SYMBOLS:
        return False
    quantized = key_cache.dtype in (torch.int8, torch.uint8)
    row = query.shape[2] + (SCALE_BYTES if quantized else 0)  # a quantized row ends in its scale
    if key_cache.dtype != torch.float32 and TILE * key_cache.shape[2] * query.shape[2] > MAX_DECODED:
        return False
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and key_cache.dtype == value_cache.dtype
        and key_cache.shape[3] == row
        and native_kernel(_symbol(key_cache)) is not None
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]  # each token's heads one row
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and query.shape[1] % key_cache.shape[2] == 0
    )


def paged_attention_native(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], float32 (or int8, head_dim + 4)
    value_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    workspace: Workspace = step_scratch,
) -> torch.Tensor:
    kernel = native_kernel(_symbol(key_cache))
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    threads = native.threads()
    layout = batch.derived.get("native")
    if layout is None or layout.threads != threads:  # the same for every layer of the step
        layout = batch.derived["native"] = _layout(batch, threads)
    tables, starts, lens, bounds = layout.tables, layout.starts, layout.lens, layout.bounds
    slices = min(layout.slices, num_kv_heads)
    chunks = (len(bounds) - 1) * slices
    threads = min(threads, chunks)
    # Spent by the layer's output projection before the next attention: fresh pages each layer cost more.
    out = workspace.take_if_large("attention output", tuple(query.shape), query.dtype, query.device)
    # Each thread's scores of a block's rows and heads, or a prompt block's keys, values and scores.
    longest = layout.longest + KEY_PAD
    scratch = max(QUERY_BLOCK * num_heads, -(-head_dim // 32) * 32 + BLOCK_HEADS * QUERY_BLOCK) * longest
    scores = workspace.take("scores", (threads, scratch), torch.float32, query.device)  # a row each thread
    # The kernel's arguments before its counters and wait, and those after them up to the scores.
    inputs = (
        query.data_ptr(),
        query.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        starts.data_ptr(),
        lens.data_ptr(),
        bounds.data_ptr(),
        chunks,
    )
    shape = (num_heads, num_kv_heads, head_dim, block_size, scale, window or 0, slices)
    task = getattr(kernel, "task", None)
    if task is not None:
        words = (*inputs, *shape, scores.data_ptr(), scratch, out.data_ptr())  # cpu_attention.c's task words
        if native.share_task(task, words, threads, kernel.__name__) is not None:
            return out
    counters = native.new_counters()

    def run(thread: int, wait: bool) -> None:
        kernel(*inputs, counters, wait, *shape, scores[thread].data_ptr(), out.data_ptr())

    native.share(run, threads, kernel.__name__)
    return out


@dataclass(slots=True)
class Layout:
    """How `paged_attention_native` serves a step, the same for each of its layers: the runs of queries it
    takes as sequences (their block tables, first queries and context lengths), their chunks (runs
    bounds[c] .. bounds[c + 1] - 1), each cut into `slices` of its decode rows' KV heads (at most the
    layer's), for how many threads, and the longest context its scratch holds."""

    tables: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor
    bounds: torch.Tensor
    threads: int
    longest: int
    slices: int


def _layout(batch: PagedBatch, threads: int) -> Layout:
    parts = threads * CHUNKS_PER_THREAD if threads > 1 else 1
    query_start, context_lens = batch.query_start_list, batch.context_lens_list
    pieces = _pieces(query_start, context_lens, parts)
    # Each run as a sequence: its queries from its first, its context ending at its last query.
    starts = [query_start[s] + first for s, first, _ in pieces] + [query_start[-1]]
    lens = [context_lens[s] - (query_start[s + 1] - query_start[s]) + end for s, _, end in pieces]
    bounds = _split(starts, lens, parts)
    tables = batch.block_tables.to(torch.int32)
    if len(pieces) > len(context_lens):
        tables = tables[[s for s, _, _ in pieces]]
    return Layout(
        tables.contiguous(),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor([first for first, _ in bounds] + [bounds[-1][1]], dtype=torch.int64),
        threads,
        max(context_lens),
        head_slices(query_start, threads),
    )


def head_slices(query_start: list[int], threads: int) -> int:
    """Into how many slices of their KV heads a step's decode rows are cut: one per thread where the rows are
    fewer than the threads (a lone row's attention would leave the others waiting), else 1. A step with a
    prompt keeps its rows whole: its prompt is the work the threads share."""
    sequences = len(query_start) - 1
    return threads if sequences < threads and query_start[-1] == sequences else 1


def decode_chunks(sequences: int, threads: int) -> int:
    """How many chunks `paged_attention_native` cuts a step of `sequences` one-query sequences into, at most."""
    return min(threads * CHUNKS_PER_THREAD, sequences) if threads > 1 else 1


def pin_decode_layout(batch: PagedBatch, threads: int, bounds: torch.Tensor, longest: int) -> None:
    """For a step of one query per sequence, the `Layout` `paged_attention_native` would work out, in tensors
    that stay put: the batch's own, and `bounds` (`decode_chunks` + 1 of them) cut as it would cut them, its last
    chunks empty where fewer are cut, so that every step has as many; scratch for contexts up to `longest`. A
    replayed step's calls read these (kernels/replay.py)."""
    ranges = _split(batch.query_start_list, batch.context_lens_list, len(bounds) - 1)
    ends = [end for _, end in ranges]
    bounds.copy_(torch.tensor([0, *ends, *[ends[-1]] * (len(bounds) - 1 - len(ranges))]))
    batch.derived["native"] = Layout(
        batch.block_tables,
        batch.query_start_loc,
        batch.context_lens,
        bounds,
        threads,
        longest,
        head_slices(batch.query_start_list, threads),
    )


def _pieces(starts: list[int], lens: list[int], parts: int) -> list[tuple[int, int, int]]:
    """The step's sequences as (sequence, first query, end query) pieces for the threads to share: a
    sequence with more than a part's work (a long prompt among few) cut into runs of queries, whole
    blocks of QUERY_BLOCK, of about equal work. A run is a sequence to the kernel: its queries are the
    last of a context that ends at its last query, over the same block table."""
    work = [_causal_work(lens[s], starts[s + 1] - starts[s], 0, starts[s + 1] - starts[s]) for s in range(len(lens))]
    share = sum(work) / max(parts, 1)
    pieces = []
    for s, context in enumerate(lens):
        queries = starts[s + 1] - starts[s]
        cuts = max(1, min(int(work[s] // share), queries // QUERY_BLOCK)) if parts > 1 and share else 1
        first = 0
        for k in range(1, cuts):
            if first + QUERY_BLOCK >= queries:
                break
            target = work[s] * k / cuts
            end = first + QUERY_BLOCK
            while end + QUERY_BLOCK < queries and _causal_work(context, queries, 0, end) < target:
                end += QUERY_BLOCK
            pieces.append((s, first, end))
            first = end
        pieces.append((s, first, queries))
    return pieces


def _causal_work(context: int, queries: int, first: int, end: int) -> int:
    """Positions seen by queries first .. end - 1 of `queries` that end a context of `context`."""
    seen_before = context - queries
    return (end - first) * seen_before + (end * (end + 1) - first * (first + 1)) // 2


def _split(starts: list[int], lens: list[int], parts: int) -> list[tuple[int, int]]:
    """Consecutive ranges of sequences with about equal work (queries times context) each, at most `parts`."""
    costs = [(starts[s + 1] - starts[s]) * lens[s] for s in range(len(lens))]
    parts = min(parts, len(lens))
    if parts <= 1:
        return [(0, len(lens))]
    ranges: list[tuple[int, int]] = []
    share, first, running = sum(costs) / parts, 0, 0
    for s, cost in enumerate(costs):
        running += cost
        if running >= share * (len(ranges) + 1) and len(ranges) < parts - 1:
            ranges.append((first, s + 1))
            first = s + 1
    ranges.append((first, len(lens)))
    return [r for r in ranges if r[0] < r[1]]


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    workspace: Workspace = step_scratch,
) -> torch.Tensor:
    starts, lens = batch.query_start_list, batch.context_lens_list
    decode = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    if len(decode) == len(lens):
        return _decode(query, key_cache, value_cache, batch, None, scale, window, workspace)
    out = torch.empty_like(query)
    if decode:
        rows = torch.tensor([starts[s] for s in decode], dtype=torch.int64, device=query.device)
        seqs = torch.tensor(decode, dtype=torch.int64, device=query.device)
        out[rows] = _decode(
            query[rows], key_cache, value_cache, batch, seqs, scale, window, workspace, [lens[s] for s in decode]
        )
    for s, context_len in enumerate(lens):
        begin, end = starts[s], starts[s + 1]
        if end - begin > 1:
            out[begin:end] = attend_one(
                query[begin:end], key_cache, value_cache, batch.block_tables[s], context_len, scale, window
            )
    return out


def _decode(
    query,
    key_cache,
    value_cache,
    batch: PagedBatch,
    seqs: torch.Tensor | None,
    scale,
    window,
    workspace: Workspace,
    lens: list[int] | None = None,
) -> torch.Tensor:
    """One query per sequence: gather every sequence's keys and values, attend in one call."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    lens = batch.context_lens_list if lens is None else lens
    num_blocks = -(-max(lens) // block_size)
    width = num_blocks * block_size
    derived = batch.derived.get(("decode", block_size, window))
    if derived is None:  # the same for every layer of the step
        tables = batch.block_tables[:, :num_blocks] if seqs is None else batch.block_tables[seqs, :num_blocks]
        context = torch.tensor(lens, dtype=torch.int64, device=query.device)[:, None]
        key_pos = torch.arange(width, device=query.device)[None, :]
        mask = key_pos < context
        if window is not None:
            mask &= key_pos >= context - window
        derived = batch.derived[("decode", block_size, window)] = (tables.reshape(-1), mask[:, None, None, :])
    flat, mask = derived
    # A few sequences at a time, so that the gathered keys and values are still in cache when
    # attention reads them: memory traffic, not arithmetic, bounds this loop.
    seq_bytes = 2 * width * num_kv_heads * head_dim * key_cache.element_size()
    chunk = max(1, min(num_seqs, CHUNK_BYTES // seq_bytes))
    shape = (chunk * num_blocks, block_size, num_kv_heads, head_dim)
    key_buffer = workspace.take("keys", shape, key_cache.dtype, query.device)
    value_buffer = workspace.take("values", shape, value_cache.dtype, query.device)
    queries = query.view(num_seqs, num_heads, 1, head_dim)
    out = torch.empty_like(queries)
    for first in range(0, num_seqs, chunk):
        last = min(num_seqs, first + chunk)
        rows = slice(first * num_blocks, last * num_blocks)
        count = (last - first) * num_blocks
        keys = torch.index_select(key_cache, 0, flat[rows], out=key_buffer[:count])
        values = torch.index_select(value_cache, 0, flat[rows], out=value_buffer[:count])
        keys = keys.view(last - first, width, num_kv_heads, head_dim).transpose(1, 2).to(query.dtype)
        values = values.view(last - first, width, num_kv_heads, head_dim).transpose(1, 2).to(query.dtype)
        out[first:last] = F.scaled_dot_product_attention(
            queries[first:last],
            keys,
            values,
            attn_mask=mask[first:last],
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    return out.view(num_seqs, num_heads, head_dim)


def attend_one(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """One sequence's queries (its last `len(query)` tokens) against its `context_len` keys."""
    num_queries, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    blocks = table[: -(-context_len // block_size)].long()
    keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len].transpose(0, 1).to(query.dtype)
    values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len].transpose(0, 1).to(query.dtype)
    gqa = num_heads != num_kv_heads
    q = query.transpose(0, 1)  # [heads, queries, dim]
    if num_queries == context_len and window is None:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        query_pos = torch.arange(context_len - num_queries, context_len, device=query.device)[:, None]
        key_pos = torch.arange(context_len, device=query.device)[None, :]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)
