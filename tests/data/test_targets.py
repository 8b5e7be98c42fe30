"""The batch's target contract (flexengine/data/targets.py): each helper against a loop over positions that applies
the definition directly -- position t predicts labels[t + 1] unless that is IGNORE_INDEX."""

from __future__ import annotations

import torch

from flexengine.data.targets import (
    IGNORE_INDEX,
    batch_valid_targets,
    count_valid_targets,
    predicting_positions,
    shift_targets,
)


def _labels(seed: int, B: int = 3, S: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.4] = IGNORE_INDEX  # prompts, padding, document starts
    return labels


def _reference(labels: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, position, target) for every position with a next-token target, by the definition."""
    B, S = labels.shape
    return [(b, t, int(labels[b, t + 1])) for b in range(B) for t in range(S - 1) if labels[b, t + 1] != IGNORE_INDEX]


def test_shift_puts_each_target_beside_the_token_that_predicts_it():
    for seed in range(5):
        labels = _labels(seed)
        targets = shift_targets(labels)
        expected = torch.full_like(labels, IGNORE_INDEX)
        for b, t, target in _reference(labels):
            expected[b, t] = target
        assert torch.equal(targets, expected)
        assert (targets[:, -1] == IGNORE_INDEX).all()  # the last token of a row predicts nothing


def test_counts_and_positions_follow_the_definition():
    for seed in range(5):
        labels = _labels(seed)
        ref = _reference(labels)
        S = labels.shape[1]
        assert int(count_valid_targets(labels)) == len(ref)
        assert predicting_positions(labels).tolist() == [b * S + t for b, t, _ in ref]  # flat [B*S], ascending


def test_a_label_at_position_0_is_never_a_target():
    labels = torch.full((1, 4), IGNORE_INDEX)
    labels[0, 0] = 7  # nothing precedes the first token, so nothing predicts it
    assert int(count_valid_targets(labels)) == 0 and predicting_positions(labels).numel() == 0


def test_batch_count_reads_a_context_parallel_shard_by_its_targets():
    labels = _labels(0)
    full = {"labels": labels}
    assert int(batch_valid_targets(full)) == len(_reference(labels))
    targets = shift_targets(labels)
    shards = [{"targets": half, "labels": torch.zeros_like(half)} for half in targets.chunk(2, dim=1)]
    # a shard's labels no longer line up with its neighbour's tokens: only its targets count
    assert sum(int(batch_valid_targets(s)) for s in shards) == len(_reference(labels))
