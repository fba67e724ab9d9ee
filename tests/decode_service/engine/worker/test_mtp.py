"""The speculator's host-side pieces that need no drafter forward: `Tokens` (a request's tokens read in place) and
`remember` (a step's trunk rows written to the prefix-row pool in one scatter)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from decode_service.engine.worker.mtp import MTPSpeculator, Tokens


@pytest.mark.parametrize("head,tail", [([1, 2, 3], [4, 5]), ([], [4, 5]), ([1, 2, 3], []), ([], [])])
def test_tokens_read_like_the_concatenated_list(head, tail) -> None:
    tokens, joined = Tokens(head, tail), head + tail
    assert len(tokens) == len(joined) and list(tokens) == joined
    for i in range(-len(joined), len(joined)):
        assert tokens[i] == joined[i]
    bounds = range(-len(joined) - 2, len(joined) + 3)
    for start in (*bounds, None):
        for stop in (*bounds, None):
            assert tokens[start:stop] == joined[start:stop], (start, stop)
    assert tokens[::2] == joined[::2]
    with pytest.raises(IndexError):
        tokens[len(joined)]


def test_tokens_are_the_lists_as_they_were_made() -> None:
    head, tail = [1, 2], [3]
    tokens = Tokens(head, tail)
    tail.append(4)
    assert len(tokens) == 3 and tokens[-2:] == [2, 3] and list(tokens) == [1, 2, 3]
    assert len(Tokens(head, tail)) == 4


def test_remember_writes_every_sequences_rows_at_their_pages() -> None:
    hidden_size, page = 3, 4
    weight = torch.zeros(1, hidden_size)
    drafter = SimpleNamespace(
        num_depths=1, embed=SimpleNamespace(weight=weight), config=SimpleNamespace(hidden_size=hidden_size)
    )
    spec = MTPSpeculator(drafter, 1)
    spec.enable_prefix_rows(num_pages=6, page_size=page)
    hidden = torch.arange(7 * hidden_size, dtype=torch.float32).view(7, hidden_size) + 1
    # Sequence a: positions 2..5 from hidden rows 0..3 (pages 5, then 1); b: position 9 from hidden row 6 (page 3).
    spec.remember(hidden, [([5, 1], 2, 0, 4), ([0, 2, 3], 9, 6, 1), ([4], 0, 4, 0)])
    expected = torch.zeros_like(spec.rows)
    for flat, row in [(5 * page + 2, 0), (5 * page + 3, 1), (1 * page + 0, 2), (1 * page + 1, 3), (3 * page + 1, 6)]:
        expected[flat] = hidden[row]
    assert torch.equal(spec.rows, expected)
    assert torch.equal(spec.valid, expected.abs().sum(-1) > 0)
