"""loop/state.py: the run's shared counters, restored in place from a checkpoint."""

from __future__ import annotations

from flexengine.loop.state import TrainState


def test_train_state_restores_in_place_with_defaults_for_what_a_checkpoint_lacks():
    state = TrainState(step=9, best_step=4, losses=[1.0])
    state.restore({"step": 2, "losses": [3.0, 2.0], "block_sparsity_sum": 0.5, "unknown_counter": 1})
    assert (state.step, state.losses, state.block_density_sum, state.best_step) == (2, [3.0, 2.0], 0.5, 0)
