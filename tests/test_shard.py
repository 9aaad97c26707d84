"""How a process's share of a list is dealt: every item to exactly one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlhfkit.run.distributed import Shard


def shards(world: int) -> list[Shard]:
    return [Shard(SimpleNamespace(process_index=r, num_processes=world)) for r in range(world)]


def test_span_gives_each_process_a_contiguous_share_of_near_equal_size():
    assert [s.span(10) for s in shards(3)] == [slice(0, 3), slice(3, 6), slice(6, 10)]
    for world in (1, 2, 3, 4):
        for n in range(12):
            parts = [list(range(n))[s.span(n)] for s in shards(world)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("world", [1, 2, 3])
def test_chunks_are_dealt_round_robin_and_cover_every_item_once(world):
    n, size = 11, 2
    dealt = [s.chunks(n, size) for s in shards(world)]
    if world == 3:  # chunks 0..5 of 2 items (the last of 1) to ranks 0, 1, 2, 0, 1, 2
        assert dealt == [[slice(0, 2), slice(6, 8)], [slice(2, 4), slice(8, 10)], [slice(4, 6), slice(10, 11)]]
    items = sorted(i for chunks in dealt for c in chunks for i in range(n)[c])
    assert items == list(range(n))
