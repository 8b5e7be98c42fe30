"""Compiled decoder blocks: one graph for all blocks under every memory policy, SAC keeps flex's output, and
the compile counter counts fullgraph recompiles."""

from __future__ import annotations

import pytest
import torch

from flexengine.core.config import MemoryConfig
from flexengine.planning.activations import recompute_flops_per_block
from flexengine.planning.shapes import ModelShape, Workload
from flexengine.surgery.applied import applied
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.compile import CompileWatch, apply_compile, needs_compiled_blocks
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
from flexengine.surgery.memory.spec import Recompute
from tests.helpers import clone_model, make_llama

S = 64


def _batch(seed: int = 1, B: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, S), generator=g)
    pos = torch.cat([torch.arange(S // 2), torch.arange(S // 2)]).expand(B, S).clone()
    return {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}


def test_compile_watch_counts_fullgraph_recompiles():
    """fullgraph compiles never touch counters["frames"]; the watch must still see the recompile."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 + 1, backend="aot_eager", fullgraph=True, dynamic=False)
    watch = CompileWatch()
    f(torch.randn(3))
    first = watch.stats()
    assert (first.graphs, first.recompiles) == (1, 0)
    watch.start()
    f(torch.randn(3))  # same shape: cached
    assert (watch.stats().graphs, watch.stats().recompiles) == (0, 0)
    f(torch.randn(5))  # new static shape: a guard fails, the frame compiles again
    again = watch.stats()
    assert (again.graphs, again.recompiles) == (1, 1)
    assert "size mismatch" in again.reasons[0]


POLICIES = {  # checkpoint-only policies share the wrapper with these (tests/memory covers their grads)
    "ops": (MemoryConfig(policy="selective", granularity="ops"), 1),
    "offload": (MemoryConfig(policy="offload"), 1),
    "attention + offload": (MemoryConfig(policy="selective", granularity="attention", offload=True), 1),
    "full + offload": (MemoryConfig(policy="full", offload=True), 1),
    "full every_2": (MemoryConfig(policy="full", layers="every_2"), 2),  # two kinds of block, two graphs
}


@pytest.mark.slow
def test_every_memory_policy_shares_one_graph_across_32_blocks():
    """Before: offload made a class per block, so 32 blocks were 32 graphs (FailOnRecompileLimitHit at 9)."""
    base = make_llama(num_hidden_layers=32, hidden_size=32, intermediate_size=64)
    for name, (memory, kinds) in POLICIES.items():
        torch._dynamo.reset()
        model = patch_attention(clone_model(base), mode="packed_doc", backend="dense")
        apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
        apply_compile(model, "aot_eager")
        model.train()
        watch = CompileWatch()
        forward_loss_sum(model, _batch()).backward()
        stats = watch.stats()
        assert stats.graph_breaks == 0, name
        assert stats.graphs == kinds and stats.recompiles == kinds - 1, f"{name}: {stats}"
        assert len(set(applied(model).memory)) == kinds


def _flex_graphs_in_backward(memory: MemoryConfig, monkeypatch) -> tuple[int, int, dict]:
    """Flex forwards and matmuls inside the compiled backward graphs of a 2-block LLaMA, and its grads."""
    import torch.nn.attention.flex_attention as fa
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    # FlexAttention refuses CPU inputs that require grad (its CPU backward kernel is missing); its math
    # implementation, which aot_eager runs, works on CPU: let it, to inspect the partitioned graphs here.
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    backward_graphs = []

    def keep_backward(gm, example_inputs):
        backward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=keep_backward,
        partition_fn=min_cut_rematerialization_partition,
    )  # inductor's partitioner
    torch._dynamo.reset()
    model = patch_attention(make_llama(), mode="packed_doc", backend="flex", compile=True)
    apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
    apply_compile(model, backend)
    model.train()
    forward_loss_sum(model, _batch()).backward()
    flex = torch.ops.higher_order.flex_attention
    nodes = [node.target for gm in backward_graphs for node in gm.graph.nodes]
    mm = sum(t in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) for t in nodes)
    return sum(t is flex for t in nodes), mm, {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.slow
def test_sac_saves_flex_attention_instead_of_recomputing_it(monkeypatch):
    sac = MemoryConfig(policy="selective", granularity="ops")
    recomputed, sac_mm, grads = _flex_graphs_in_backward(sac, monkeypatch)
    assert recomputed == 0, "op-level SAC re-ran flex attention in backward"
    # the planner's figure for ops is 0 recompute FLOPs: backward runs exactly the matmuls of no policy
    _, plain_mm, _ = _flex_graphs_in_backward(MemoryConfig(), monkeypatch)
    assert (
        sac_mm == plain_mm
        and recompute_flops_per_block(ModelShape(64, 4, 2, 16, 128, 2, 256, 0), Workload(1, S), Recompute.OPS) == 0
    )
    # the check can fail: full checkpointing does recompute flex (and the matmuls) in backward
    full, full_mm, _ = _flex_graphs_in_backward(MemoryConfig(policy="full"), monkeypatch)
    assert full >= 1 and full_mm > plain_mm
    reference = patch_attention(make_llama(), mode="packed_doc", backend="dense")
    forward_loss_sum(reference.train(), _batch()).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sac_with_flex_compiles_the_blocks_even_without_train_compile():
    model = patch_attention(make_llama(), mode="packed_doc", backend="flex", compile=True)
    assert needs_compiled_blocks(model) is None
    apply_memory_policy(
        model, block_memory_specs(MemoryConfig(policy="selective", granularity="ops"), model.config.num_hidden_layers)
    )
    assert "SAC" in needs_compiled_blocks(model)
    dense = patch_attention(make_llama(), mode="packed_doc", backend="dense")
    apply_memory_policy(
        dense, block_memory_specs(MemoryConfig(policy="selective", granularity="ops"), dense.config.num_hidden_layers)
    )
    assert needs_compiled_blocks(dense) is None  # SAC sees the dense backend's SDPA op in eager code


def test_sac_with_offload_compiles_the_blocks_so_offload_sees_what_sac_keeps():
    """Eager SAC keeps its op outputs outside autograd's saved tensors, where offload's hooks never reach: only the
    checkpoint's input would go to the host. Compiled, the kept outputs are saved tensors and are offloaded."""
    for backend in ("dense", "flex"):
        model = patch_attention(make_llama(), mode="packed_doc", backend=backend)
        apply_memory_policy(
            model,
            block_memory_specs(
                MemoryConfig(policy="selective", granularity="ops", offload=True), model.config.num_hidden_layers
            ),
        )
        assert "offload" in needs_compiled_blocks(model)
    plain = patch_attention(make_llama(), mode="packed_doc", backend="dense")
    apply_memory_policy(
        plain, block_memory_specs(MemoryConfig(policy="full", offload=True), plain.config.num_hidden_layers)
    )
    assert needs_compiled_blocks(plain) is None  # a whole-block checkpoint's input is a saved tensor


def test_a_must_compile_block_that_runs_uncompiled_stops_training_with_the_block_and_the_cause(tmp_path):
    """Through the real loop: op-level SAC with offload must run compiled (eager SAC keeps its cache on the
    device). Forced to run eagerly (the stance stands in for torch 2.11's silent skip of a frame under a dispatch
    mode), training stops after the first micro-batch naming the block, the cause and what it would cost; the
    same job compiled trains."""
    from flexengine.core.errors import UserError
    from flexengine.run import run_training
    from tests.helpers import DEBUG_FAST, make_job

    job = [
        *DEBUG_FAST,
        "train.max_steps=1",
        "attn.backend=varlen",
        "memory.policy=selective",
        "memory.granularity=ops",
        "memory.offload=true",
        "train.compile_backend=aot_eager",
    ]
    with torch.compiler.set_stance("force_eager"), pytest.raises(UserError) as stopped:
        run_training(make_job(tmp_path / "eager", *job), tmp_path / "eager")
    said = str(stopped.value)
    assert "decoder block 0" in said and "ran uncompiled" in said and "set_stance('force_eager')" in said
    assert "must run compiled" in said and "offload" in said and "on the device" in said
    summary = run_training(make_job(tmp_path / "compiled", *job), tmp_path / "compiled")
    assert summary["steps"] == 1


def test_a_block_compiled_by_choice_that_runs_uncompiled_is_only_a_warning(caplog):
    from flexengine.surgery.compile import verify_compiled_blocks

    model = patch_attention(make_llama(), mode="packed_doc", backend="dense")
    apply_compile(model, "aot_eager")
    with torch.compiler.set_stance("force_eager"):
        forward_loss_sum(model.train(), _batch())
    verify_compiled_blocks(model)
    assert "ran uncompiled" in caplog.text and "force_eager" in caplog.text
    assert applied(model).compile_probe.eager_calls == [1] * model.config.num_hidden_layers
