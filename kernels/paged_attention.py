"""Paged attention over a flattened batch of prompt chunks and decode tokens.

Query row `i` of sequence `s` sits at position `context_lens[s] - num_queries + i` and attends
causally (optionally within a sliding window) to that sequence's keys, read from the paged
cache `[num_blocks, block_size, num_kv_heads, head_dim]` through its row of the block table.
The new tokens' keys and values must already be in the cache.

- `paged_attention_reference`: plain torch, one sequence at a time; the CPU path and the oracle.
- `paged_attention_triton`: one Triton kernel for mixed prefill and decode. A program takes a
  tile of query tokens times the query heads that share one KV head (stacked as the rows of
  `tl.dot`, so each KV tile is loaded once per group), walks the keys in tiles of BLOCK_N through
  the block table with an online softmax in float32, and skips tiles outside the causal window.
  For decode-only batches with long contexts it splits the keys over several programs
  ("flash-decoding") and merges their partial results by log-sum-exp in a second kernel.
  It reads an int8 or E4M3 cache (`kernels/kv_quant.py`: one-byte values, then the row's
  float32 scale) directly, dequantizing each KV tile as it loads it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels.batch import PagedBatch
from kernels.kv_quant import SCALE_BYTES

QUANTIZED = {torch.int8: 1, torch.uint8: 2}  # the kernel's QUANT: int8 rows, E4M3 rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the reference still works
    triton = None


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = batch.query_start_list
    for s, context_len in enumerate(batch.context_lens_list):
        begin, end = starts[s], starts[s + 1]
        if begin == end:
            continue
        blocks = batch.block_tables[s, : -(-context_len // block_size)].long()
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len]
        q = query[begin:end].transpose(0, 1)  # [heads, queries, dim]
        k = keys.transpose(0, 1).repeat_interleave(group, dim=0).to(query.dtype)
        v = values.transpose(0, 1).repeat_interleave(group, dim=0).to(query.dtype)
        query_pos = torch.arange(context_len - (end - begin), context_len, device=query.device)
        key_pos = torch.arange(context_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        out[begin:end] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """block_n: keys a program takes at a time, where a benchmark compares tiles; None: the kernel's choice."""
    _check(query, key_cache, value_cache, batch)
    quant = QUANTIZED.get(key_cache.dtype, 0)
    # a quantized row's scale, as a float32 word of the same cache (rows are head_dim + 4 bytes)
    key_words, value_words = (
        (key_cache.view(torch.float32), value_cache.view(torch.float32)) if quant else (key_cache, value_cache)
    )
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    max_query_len = batch.max_query_len
    decode_only = max_query_len == 1
    if num_splits is None:
        num_splits = _pick_splits(batch, num_kv_heads, query.device) if decode_only else 1
    # Rows of a program: query tokens x heads of one group, at least 16 for tl.dot.
    block_q = 1 if decode_only else max(1, min(64 // group_pad, triton.next_power_of_2(max_query_len)))
    block_q = max(block_q, 16 // group_pad)
    # One-byte caches widen a key tile to float32 before the product: at heads of 128, tiles of 64 keys
    # spill registers to local memory (ptxas for sm_90), tiles of 32 do not.
    if block_n is None:
        block_n = 64 if head_pad < 128 or (head_pad == 128 and not quant) else 32
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    out = torch.empty_like(query)
    if num_splits > 1:
        partial = torch.empty(
            (batch.num_seqs, num_splits, num_heads, head_pad), dtype=torch.float32, device=query.device
        )
        lse = torch.empty((batch.num_seqs, num_splits, num_heads), dtype=torch.float32, device=query.device)
    else:
        partial, lse = out, out  # unused
    grid = (batch.num_seqs, num_splits if num_splits > 1 else triton.cdiv(max_query_len, block_q), num_kv_heads)
    _attention_kernel[grid](
        out,
        partial,
        lse,
        query,
        key_cache,
        value_cache,
        key_words,
        value_words,
        batch.block_tables,
        batch.query_start_loc,
        batch.context_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        batch.block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        WINDOW=window or 0,
        NUM_SPLITS=num_splits,
        QUANT=quant,
        FP8_BY_HARDWARE=quant == QUANTIZED[torch.uint8] and fp8_by_hardware(query.device),
        FP32_DOT=interpreted,
        # float32 serving gets float32 products, as the model's own matmuls do; never TF32's 10-bit mantissa.
        DOT_PRECISION="ieee" if interpreted or query.dtype == torch.float32 else "tf32",
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch.num_seqs, num_heads)](
            out,
            partial,
            lse,
            batch.query_start_loc,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
        )
    return out


def fp8_by_hardware(device: torch.device) -> bool:
    """Whether E4M3 bytes are converted by the GPU's instructions (sm_89 and later; Triton's interpreter too).
    Decoding them with integer moves instead kept a tile's temporaries in local memory on an H200
    (docs/kernel-measurements.md)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _pick_splits(batch: PagedBatch, num_kv_heads: int, device: torch.device) -> int:
    """Enough key splits that few long sequences still give every SM a program."""
    programs = batch.num_seqs * num_kv_heads
    if device.type != "cuda" or batch.max_context_len < 1024:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return int(min(16, triton.cdiv(2 * sms, programs), triton.cdiv(batch.max_context_len, 512)))


def _check(query, key_cache, value_cache, batch: PagedBatch) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"expected query [T, H, D] and caches [N, B, KVH, D]; got {tuple(query.shape)}, "
            f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}"
        )
    quantized = key_cache.dtype in QUANTIZED
    row = query.shape[2] + (SCALE_BYTES if quantized else 0)  # a quantized row ends in its scale
    if row != key_cache.shape[3]:
        raise ValueError(
            f"head_dim {query.shape[2]} of the query does not fit rows of {key_cache.shape[3]} "
            f"{key_cache.dtype} in the cache"
        )
    if quantized and query.shape[2] % SCALE_BYTES:
        raise ValueError(f"a quantized cache needs head_dim a multiple of 4, not {query.shape[2]}")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not split over {key_cache.shape[2]} KV heads")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if batch.block_tables.dtype != torch.int32 or batch.context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if key_cache.dtype != query.dtype and not quantized or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"cache dtype {key_cache.dtype} != query dtype {query.dtype}")


if triton is not None:

    @triton.jit
    def _dequantize(raw, scale, QUANT: tl.constexpr, FP8_BY_HARDWARE: tl.constexpr):
        """A tile of one-byte values (QUANT 1: int8, 2: E4M3) times each row's scale, in float32.
        E4M3 is converted by the GPU's own instructions where it has them (sm_89 on); before, it is
        decoded with integer moves into float32's fields (exponent rebiased 7 -> 127; an exponent of
        0 is the subnormal range, mantissa x 2^-9), as cpu_attention.c does: the same numbers."""
        if QUANT == 1:
            values = raw.to(tl.float32)
        elif FP8_BY_HARDWARE:
            values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            byte = raw.to(tl.int32) & 0xFF
            magnitude = byte & 0x7F
            normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
            subnormal = (magnitude & 7).to(tl.float32) * 0.001953125
            values = tl.where(magnitude >= 8, normal, subnormal)
            values = tl.where((byte & 0x80) != 0, -values, values)
        return values * scale[:, None]

    @triton.jit
    def _attention_kernel(
        out_ptr,
        partial_ptr,
        lse_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        k_words_ptr,
        v_words_ptr,
        block_tables_ptr,
        query_start_ptr,
        context_lens_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_table,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        WINDOW: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        QUANT: tl.constexpr,
        FP8_BY_HARDWARE: tl.constexpr,
        FP32_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        tile = tl.program_id(1)  # a query tile, or the key split of a decode
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        context_len = tl.load(context_lens_ptr + seq)
        q_tile = tile if NUM_SPLITS == 1 else 0

        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        token = q_tile * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_valid = (token < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, HEAD_PAD)
        dim_valid = dims < HEAD_DIM
        q_rows = (q_start + token).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if FP32_DOT:
            q = q.to(tl.float32)
        q_pos = context_len - q_len + token

        # Keys this program may need: causal end of its last query row, window start of its first.
        kv_end = tl.minimum(context_len, context_len - q_len + (q_tile + 1) * BLOCK_Q)
        kv_begin = 0
        if WINDOW > 0:
            kv_begin = tl.maximum(0, context_len - q_len + q_tile * BLOCK_Q - WINDOW + 1)
            kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
        if NUM_SPLITS > 1:
            per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
            kv_begin = kv_begin + tile * per_split
            kv_end = tl.minimum(kv_end, kv_begin + per_split)

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
        for start in range(kv_begin, kv_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_valid = pos < kv_end
            block = tl.load(
                block_tables_ptr + seq.to(tl.int64) * stride_table + pos // BLOCK_SIZE, mask=pos_valid, other=0
            ).to(tl.int64)
            offset = (pos % BLOCK_SIZE).to(tl.int64)
            kv_mask = pos_valid[:, None] & dim_valid[None, :]
            k_rows = block * stride_kb + offset * stride_ks + kv_head * stride_kh
            v_rows = block * stride_vb + offset * stride_vs + kv_head * stride_vh
            k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0)
            v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0)
            if QUANT > 0:  # each row's scale is the float32 word after its HEAD_DIM bytes
                k_scale = tl.load(k_words_ptr + (k_rows + HEAD_DIM) // 4, mask=pos_valid, other=0.0)
                v_scale = tl.load(v_words_ptr + (v_rows + HEAD_DIM) // 4, mask=pos_valid, other=0.0)
                k = _dequantize(k, k_scale, QUANT, FP8_BY_HARDWARE).to(q.dtype)
                v = _dequantize(v, v_scale, QUANT, FP8_BY_HARDWARE).to(q.dtype)
            if FP32_DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
            if WINDOW > 0:
                visible &= pos[None, :] > q_pos[:, None] - WINDOW
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        has_keys = l_i > 0
        result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if NUM_SPLITS == 1:
            o_rows = (q_start + token).to(tl.int64)
            tl.store(
                out_ptr + o_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                result.to(out_ptr.dtype.element_ty),
                mask=row_valid[:, None] & dim_valid[None, :],
            )
        else:
            num_heads = tl.num_programs(2) * GROUP
            base = (seq.to(tl.int64) * NUM_SPLITS + tile) * num_heads + head
            tl.store(partial_ptr + base[:, None] * HEAD_PAD + dims[None, :], result, mask=row_valid[:, None])
            log_sum = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + base, log_sum, mask=row_valid)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,
        partial_ptr,
        lse_ptr,
        query_start_ptr,
        stride_ot,
        stride_oh,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        num_heads = tl.num_programs(1)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_PAD)
        base = (seq.to(tl.int64) * NUM_SPLITS + splits) * num_heads + head
        lse = tl.load(lse_ptr + base, mask=splits < NUM_SPLITS, other=float("-inf"))
        top = tl.max(lse, 0)
        weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))  # empty splits count for nothing
        parts = tl.load(
            partial_ptr + base[:, None] * HEAD_PAD + dims[None, :],
            mask=(splits < NUM_SPLITS)[:, None] & (weight > 0)[:, None],
            other=0.0,
        )
        merged = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
        row = tl.load(query_start_ptr + seq).to(tl.int64)
        tl.store(
            out_ptr + row * stride_ot + head * stride_oh + dims,
            merged.to(out_ptr.dtype.element_ty),
            mask=dims < HEAD_DIM,
        )
