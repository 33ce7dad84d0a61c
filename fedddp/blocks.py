"""Fixed blocks of the flat vector, and the blocks each rank owns in a sharded aggregation.

Legend: P flat elements, B columns per block (run.aggregation_block), NB = ceil(P / B) blocks,
W ranks.

Block b holds the columns [b B, min((b + 1) B, P)): its bounds depend on P and B alone, never on
the world size. Rank r owns the contiguous blocks [floor(r NB / W), floor((r + 1) NB / W)), so
the ranks' ranges follow each other in rank order and cover every block once; a rank owns no
block when NB < W. A server rule works on a range block by block, and its sums over the whole
vector are per-block sums added over the blocks in block order (strategies.Span): which rank
computed a block does not enter the bits (docs/architecture.md, "The sharded server").
"""

from __future__ import annotations


def num_blocks(numel: int, width: int) -> int:
    return -(-numel // width)


def block_range(numel: int, width: int, rank: int, world_size: int) -> tuple[int, int]:
    """The blocks [b0, b1) that ``rank`` owns."""
    count = num_blocks(numel, width)
    return rank * count // world_size, (rank + 1) * count // world_size


def column_range(numel: int, width: int, rank: int, world_size: int) -> tuple[int, int]:
    """The columns [c0, c1) of the blocks that ``rank`` owns (c0 = c1 when it owns none)."""
    b0, b1 = block_range(numel, width, rank, world_size)
    return min(b0 * width, numel), min(b1 * width, numel)


def column_ranges(numel: int, width: int, world_size: int) -> list[tuple[int, int]]:
    """Every rank's columns, in rank order (contiguous, covering [0, P))."""
    return [column_range(numel, width, r, world_size) for r in range(world_size)]


def block_slices(start: int, stop: int, width: int) -> list[slice]:
    """The blocks that make up the columns [start, stop) (start a block boundary), as slices
    relative to ``start``: what a rule iterates over a range."""
    assert start % width == 0, f"a range starts on a block boundary, not at column {start}"
    return [slice(s - start, min(s + width, stop) - start) for s in range(start, stop, width)]
