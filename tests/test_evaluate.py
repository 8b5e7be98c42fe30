"""Greedy samples (flexengine/evaluate.py greedy_continue): one padded row width per call."""

from __future__ import annotations

import torch

from flexengine.evaluate import greedy_continue
from tests.helpers import CharTokenizer


def test_prompts_of_different_lengths_share_one_row_width():
    """Every forward of one call has the same width: the longest prompt plus the new tokens, in whole pad_to
    blocks (under CP each new width is a new variant of torch's compiled mask builder, and dynamo stops the run
    after 8). Greedy tokens are read at each prompt's own last position, not at the padding."""
    widths = []

    def next_char(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # a causal "model": the logits at position t favour the character after input_ids[t]
        widths.append(input_ids.shape[1])
        assert torch.equal(position_ids[0], torch.arange(input_ids.shape[1]))
        return torch.nn.functional.one_hot((input_ids + 1) % 256, 256).float()

    prompts = ["a", "b" * 130, "c" * 300]
    texts = greedy_continue(next_char, CharTokenizer(), prompts, new_tokens=3, device=torch.device("cpu"), pad_to=256)
    assert texts == ["bcd", "cde", "def"]
    assert widths == [512] * 9  # 300 + 3 tokens -> 2 blocks of 256 for every prompt (before: 256, 256, 512)
