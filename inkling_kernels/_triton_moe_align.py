"""Triton code that groups an MoE call's (token, slot) pairs by expert into row blocks
(``inkling_kernels.moe_align.moe_align``): ``moe_align_count_kernel`` then ``moe_align_place_kernel`` over a grid. The
blocks feed ``_triton_moe``'s sorted routing."""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


@triton.jit(do_not_specialize=["n_pairs"])
def moe_align_count_kernel(
    Ids,
    Counts,
    n_pairs,
    EXPERT_ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p: ``Counts[p, e]`` = pairs of expert e among pairs ``[p * CHUNK, (p + 1) * CHUNK)`` (masked ids
    and ids past ``n_pairs`` match no expert), ``SUB`` pairs per step as one-hot rows."""
    pdl_wait(PDL)
    p = tl.program_id(0)
    experts = tl.arange(0, EXPERT_ROWS)
    offs = tl.arange(0, SUB)
    counts = tl.zeros([EXPERT_ROWS], dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        pairs = p * CHUNK + s + offs
        ids = tl.load(Ids + pairs, mask=pairs < n_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(Counts + p * EXPERT_ROWS + experts, counts)


@triton.jit(do_not_specialize=["n_pairs", "n_blocks"])
def moe_align_place_kernel(
    Ids,
    Counts,
    SortedPairs,
    BlockExpert,
    BlockRank,
    n_pairs,
    n_blocks,
    EXPERT_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    ROWS: tl.constexpr,
    FILL_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p (after ``moe_align_count_kernel`` over the same grid): from the count table, every expert's
    padded row span (experts in order) and where this program's pairs of it start (after those of the programs
    before p); then its pairs at their expert's cursor, in pair order (a stable sort: the rank of a pair among
    its step's pairs of the same expert is a cumulative sum of one-hot rows). Then, over blocks
    ``p * FILL_BLOCKS`` + a stride of the grid, each block's expert (-1 past the used blocks), its place among its
    expert's blocks (0 past the used ones) and the pad id
    ``n_pairs`` in its rows past its expert's pairs (disjoint from every pair's row: no ordering needed)."""
    pdl_wait(PDL)
    p = tl.program_id(0)
    n_programs = tl.num_programs(0)
    experts = tl.arange(0, EXPERT_ROWS)
    total = tl.zeros([EXPERT_ROWS], dtype=tl.int32)
    before = tl.zeros([EXPERT_ROWS], dtype=tl.int32)
    for r in range(0, n_programs, ROWS):
        rows = r + tl.arange(0, ROWS)
        counts = tl.load(Counts + rows[:, None] * EXPERT_ROWS + experts[None, :], mask=rows[:, None] < n_programs,
                         other=0)  # fmt: skip
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where(rows[:, None] < p, counts, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    span_end = tl.cumsum(padded, axis=0)
    span_start = span_end - padded
    cursor = span_start + before

    offs = tl.arange(0, SUB)
    for s in range(0, CHUNK, SUB):
        pairs = p * CHUNK + s + offs
        ids = tl.load(Ids + pairs, mask=pairs < n_pairs, other=-1).to(tl.int32)
        hit = ids[:, None] == experts[None, :]  # [SUB, EXPERT_ROWS]; masked and absent pairs hit nothing
        rank = tl.cumsum(hit.to(tl.int32), axis=0)  # 1 + earlier pairs of the same expert in this step
        pos = tl.sum(tl.where(hit, cursor[None, :] + rank - 1, 0), axis=1)
        tl.store(SortedPairs + pos, pairs.to(tl.int32), mask=ids >= 0)
        cursor += tl.sum(hit.to(tl.int32), axis=0)

    used_end = tl.sum(padded, axis=0)
    pairs_end = span_start + total
    rows_m = tl.arange(0, BLOCK_M)
    for b in range(p * FILL_BLOCKS, n_blocks, n_programs * FILL_BLOCKS):
        blocks = b + tl.arange(0, FILL_BLOCKS)
        first = blocks * BLOCK_M
        expert = tl.sum((span_end[None, :] <= first[:, None]).to(tl.int32), axis=1)  # EXPERT_ROWS when unused
        in_blocks = blocks < n_blocks
        used = first < used_end
        tl.store(BlockExpert + blocks, tl.where(used, expert, -1), mask=in_blocks)
        own = experts[None, :] == expert[:, None]  # [FILL_BLOCKS, EXPERT_ROWS]
        start = tl.sum(tl.where(own, span_start[None, :], 0), axis=1)
        tl.store(BlockRank + blocks, tl.where(used, (first - start) // BLOCK_M, 0), mask=in_blocks)
        end = tl.sum(tl.where(own, pairs_end[None, :], 0), axis=1)
        slots = first[:, None] + rows_m[None, :]
        pad = tl.full([FILL_BLOCKS, BLOCK_M], 0, tl.int32) + n_pairs
        tl.store(SortedPairs + slots, pad, mask=(slots >= end[:, None]) & in_blocks[:, None])
