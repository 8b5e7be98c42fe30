"""Tiled MLP: exact gradients under every policy it composes with, the recompute it claims (FlopCounterMode),
one tile's intermediates alive at a time, no graph break or recompile under compile, and the planner's bytes
against the meter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flexengine.core.config import MemoryConfig
from flexengine.core.errors import UserError
from flexengine.planning.activations import (
    block_working_bytes,
    estimate_activations,
    memory_specs,
    recompute_flops_per_block,
)
from flexengine.planning.shapes import ModelShape, Workload
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.compile import apply_compile
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs, measure_activations
from flexengine.surgery.memory.meter import measure_peak_bytes
from flexengine.surgery.memory.spec import Recompute
from tests.helpers import clone_model, make_llama

B, S = 2, 64  # 128 tokens: tiles of 48 leave an uneven last tile of 32

POLICIES = {
    "none": MemoryConfig(tiled_mlp=48),
    "full": MemoryConfig(policy="full", tiled_mlp=16),
    "full every_2": MemoryConfig(policy="full", layers="every_2", tiled_mlp=48),
    "attention": MemoryConfig(policy="selective", granularity="attention", tiled_mlp=48),
    "ops": MemoryConfig(policy="selective", granularity="ops", tiled_mlp=16),
    "offload": MemoryConfig(policy="offload", tiled_mlp=48),
    "full + offload": MemoryConfig(policy="full", offload=True, tiled_mlp=16),
}


def _batch(vocab: int = 256) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    pos = torch.cat([torch.arange(S // 2), torch.arange(S // 2)]).expand(B, S).clone()  # row 0: two documents
    labels = ids.clone()
    labels[1, :5] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def _model(base, memory: MemoryConfig, compile_backend: str = "") -> torch.nn.Module:
    model = clone_model(base)
    patch_attention(model, mode="packed_doc", backend="dense")
    apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
    if compile_backend:
        apply_compile(model, backend=compile_backend)  # the engine's path: every block fullgraph
    return model.train()


def _grads(model: torch.nn.Module, chunk_size: int = 0) -> tuple[torch.Tensor, dict]:
    loss = forward_loss_sum(model, _batch(), chunk_size)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def base():
    return make_llama(num_hidden_layers=3).double()  # fp64: tiling only reorders sums, so equal to ~1e-15


@pytest.fixture(scope="module")
def reference(base):
    return _grads(_model(base, MemoryConfig()))


@pytest.mark.parametrize("name", list(POLICIES))
def test_tiled_mlp_gives_untiled_grads(base, reference, name):
    loss, grads = _grads(_model(base, POLICIES[name]), chunk_size=37)
    torch.testing.assert_close(loss, reference[0], rtol=1e-12, atol=1e-12)
    for n, g in reference[1].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-12, msg=f"{name}: grad of {n}")


def test_tiled_mlp_compiles_without_break_or_recompile(base, reference):
    """fullgraph=True (aot_eager) raises on a graph break; one graph serves every block, even nested in the
    block checkpoint."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    loss, grads = _grads(_model(base, MemoryConfig(policy="full", tiled_mlp=48), compile_backend="aot_eager"))
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(loss, reference[0], rtol=1e-12, atol=1e-12)
    for n, g in reference[1].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-12, msg=f"compiled: grad of {n}")


def _train_flops(model: torch.nn.Module) -> int:
    with FlopCounterMode(display=False) as counter:
        forward_loss_sum(model, _batch()).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "memory", [MemoryConfig(tiled_mlp=16), MemoryConfig(policy="selective", granularity="attention", tiled_mlp=48)]
)
def test_backward_flops_match_claimed_tile_recompute(base, memory):
    """Each tile re-runs gate_proj + up_proj in backward (non-reentrant checkpoint stops before down_proj): the
    planner's estimate, exactly (FlopCounterMode counts matmuls, not the CPU flash-attention kernel)."""
    extra = _train_flops(_model(base, memory)) - _train_flops(_model(base, MemoryConfig()))
    shape = ModelShape.from_hf_config(base.config)
    claimed = estimate_activations(
        shape, Workload(B, S, 8, AttnBackend.DENSE), memory_specs(memory, shape), count_attention_core=False
    )
    assert extra == claimed.recompute_flops
    assert (
        extra
        >= shape.layers * recompute_flops_per_block(shape, Workload(B, S, 8, AttnBackend.DENSE), Recompute.MLP)
        > 0
    )


def test_only_one_tile_of_the_intermediate_is_ever_alive():
    """Under full checkpointing the peak is the backward recompute of one block: untiled it holds gate, up,
    silu(gate), their product and two gradients of that size for all 1024 tokens; tiled, for 128 -- the
    planner's block_working_bytes."""
    base = make_llama(
        hidden_size=32,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    batch = {"input_ids": torch.randint(0, 64, (1, 1024), generator=torch.Generator().manual_seed(0))}
    batch.update(labels=batch["input_ids"], position_ids=torch.arange(1024)[None])
    peaks = {}
    for tile in (0, 128):
        model = _model(base, MemoryConfig(policy="full", tiled_mlp=tile))
        peaks[tile] = measure_peak_bytes(lambda m=model: forward_loss_sum(m, batch).backward())
    shape = ModelShape.from_hf_config(base.config)
    saved = block_working_bytes(shape, Workload(1, 1024, 4, AttnBackend.DENSE)) - block_working_bytes(
        shape, Workload(1, 1024, 4, AttnBackend.DENSE, mlp_tile=128)
    )
    assert saved == 6 * 4 * (1024 - 128) * 512  # 6 fp32 [tokens, intermediate] tensors, 7 of 8 tiles fewer
    assert peaks[0] - peaks[128] == pytest.approx(saved, rel=0.05)


@pytest.mark.parametrize(
    "memory",
    [
        MemoryConfig(tiled_mlp=128),
        MemoryConfig(policy="full", tiled_mlp=128),
        MemoryConfig(policy="selective", granularity="attention", tiled_mlp=200),
        MemoryConfig(policy="full", offload=True, tiled_mlp=128),
    ],
)
def test_planner_within_5_percent_of_meter(memory):
    """Bytes saved for backward at shrunk width (H128, f344, 3 blocks, 768 tokens, fp32, dense attention)."""
    small = make_llama(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    ids = torch.randint(0, 512, (1, 768), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.arange(768)[None], "labels": ids}
    model = _model(small, memory)
    report, _ = measure_activations(model, lambda: forward_loss_sum(model, batch))
    shape = ModelShape.from_hf_config(small.config)
    est = estimate_activations(shape, Workload(1, 768, 4, AttnBackend.DENSE), memory_specs(memory, shape))
    assert est.total_bytes == pytest.approx(report.total_bytes, rel=0.05)
    assert est.offloaded_bytes == pytest.approx(report.offloaded_bytes, rel=0.05)


@pytest.mark.parametrize("value,match", [(-1, "memory.tiled_mlp=-1"), ("big", "memory.tiled_mlp='big'")])
def test_bad_tiled_mlp_is_refused(value, match):
    with pytest.raises(UserError, match=match):
        MemoryConfig(tiled_mlp=value)
    with pytest.raises(UserError, match="granularity=mlp would recompute it again"):
        MemoryConfig(policy="selective", granularity="mlp", tiled_mlp=1024)
