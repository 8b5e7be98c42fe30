"""`MemorySpec` (flexengine/surgery/memory/spec.py): memory.* resolved into one spec per block, and what each
recompute re-runs, on block parts of distinct powers of two so every sum below names its parts."""

from __future__ import annotations

import pytest

from flexengine.core.config import MemoryConfig
from flexengine.core.errors import UserError
from flexengine.surgery.memory.spec import BlockFlops, MemorySpec, Recompute, block_memory_specs

# q/k/v = 1, core = 2, o_proj = 4, gate/up = 8, o_proj's re-run end = 16, down_proj's re-run end = 32
PARTS = BlockFlops(
    attention_inputs=1, attention_core=2, attention_output=4, mlp_inputs=8, attention_output_end=16, mlp_output_end=32
)


@pytest.mark.parametrize(
    ("recompute", "flops"),
    [
        ("none", 0),
        ("block", 1 + 2 + 4 + 8 + 32),  # everything but o_proj's end: o_proj re-runs whole inside the block
        ("attention", 1 + 2 + 16),  # q/k/v, core, and o_proj up to where the checkpoint ends
        ("mlp", 8 + 32),
        ("ops", 0),  # SAC keeps every matmul and the attention output: pointwise traffic only
    ],
)
def test_each_recompute_reruns_its_parts(recompute, flops):
    assert Recompute(recompute).flops(PARTS) == flops


def test_tiles_add_gate_and_up_on_top_of_the_blocks_recompute():
    spec = MemorySpec(Recompute.BLOCK, mlp_tile=512)
    assert spec.recompute_flops(PARTS, mlp_tiled=True) == 47 + 40
    assert spec.recompute_flops(PARTS, mlp_tiled=False) == 47  # a single tile is not tiled: no extra re-run
    assert spec.recomputed_pointwise_ops(mlp_tiled=True) == ("norm1", "rope", "norm2", "swiglu", "residual", "swiglu")
    assert MemorySpec(Recompute.ATTENTION).recomputed_pointwise_ops(mlp_tiled=False) == ("rope",)


@pytest.mark.parametrize(("tile", "tokens", "tiled"), [(0, 4096, False), (4096, 4096, False), (1024, 4096, True)])
def test_an_mlp_is_tiled_only_over_more_than_one_tile(tile, tokens, tiled):
    assert MemorySpec(mlp_tile=tile).tiles_mlp(tokens) is tiled


@pytest.mark.parametrize(
    ("recompute", "wraps", "core"),
    [
        ("none", False, False),
        ("block", True, True),
        ("attention", True, True),
        ("mlp", False, False),
        ("ops", True, False),
    ],
)
def test_which_recomputes_hold_the_attention_call_and_rerun_its_core(recompute, wraps, core):
    assert Recompute(recompute).wraps_attention is wraps and Recompute(recompute).reruns_attention_core is core


@pytest.mark.parametrize(
    ("spec", "label", "changes"),
    [
        (MemorySpec(), "none", False),
        (MemorySpec(Recompute.OPS), "ops", True),
        (MemorySpec(offload=True), "none+offload", True),
        (MemorySpec(mlp_tile=4096), "none+mlp_tile4096", True),
        (MemorySpec(Recompute.BLOCK, offload=True, mlp_tile=4096), "block+offload+mlp_tile4096", True),
    ],
)
def test_label_and_whether_the_block_is_wrapped(spec, label, changes):
    assert spec.describe() == label and spec.changes_block is changes


def test_the_selected_blocks_get_the_policy_and_every_block_the_tiles():
    specs = block_memory_specs(MemoryConfig(policy="full", layers="every_2", tiled_mlp=256), 4)
    plain, checkpointed = MemorySpec(mlp_tile=256), MemorySpec(Recompute.BLOCK, mlp_tile=256)
    assert specs == (plain, checkpointed, plain, checkpointed)


@pytest.mark.parametrize(
    ("memory", "selected"),
    [
        (MemoryConfig(policy="none"), MemorySpec()),
        (
            MemoryConfig(policy="selective", granularity="attention", offload=True),
            MemorySpec(Recompute.ATTENTION, True),
        ),
        (MemoryConfig(policy="selective", granularity="ops"), MemorySpec(Recompute.OPS)),
        (MemoryConfig(policy="offload"), MemorySpec(Recompute.NONE, offload=True)),  # offload keeps, no recompute
    ],
)
def test_each_policy_becomes_its_spec_on_every_block(memory, selected):
    assert block_memory_specs(memory, 3) == (selected,) * 3


@pytest.mark.parametrize("memory", [MemoryConfig(policy="auto"), MemoryConfig(policy="full", tiled_mlp="auto")])
def test_auto_is_refused_until_the_planner_resolves_it(memory):
    with pytest.raises(UserError, match="must be resolved to a concrete policy by the planner first"):
        block_memory_specs(memory, 2)


def test_a_concrete_policy_whose_fields_were_nulled_after_validation_is_refused_by_name():
    """MemoryConfig fills layers/granularity/offload under a concrete policy; one changed after that is not
    silently read as all / block / false."""
    memory = MemoryConfig(policy="full")
    memory.offload = None
    with pytest.raises(ValueError, match=r"memory.offload=None.*memory.policy=full"):
        block_memory_specs(memory, 2)
