"""Every memory policy gives the gradients of no policy, recomputes what it claims, and compiles without breaks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flexengine.core.config import MemoryConfig
from flexengine.core.errors import UserError
from flexengine.planning.activations import recompute_flops_per_block
from flexengine.planning.shapes import ModelShape, Workload
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.compile import apply_compile
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs, select_layers
from flexengine.surgery.memory.spec import MemorySpec, Recompute
from tests.helpers import clone_model, make_llama

B, S = 2, 64

POLICIES = {
    "full": MemoryConfig(policy="full"),
    "full every_2": MemoryConfig(policy="full", layers="every_2"),
    "full first_1": MemoryConfig(policy="full", layers="first_1"),
    "full last_1": MemoryConfig(policy="full", layers="last_1"),
    "full list": MemoryConfig(policy="full", layers="0,2"),
    "attention": MemoryConfig(policy="selective", granularity="attention"),
    "mlp": MemoryConfig(policy="selective", granularity="mlp"),
    "ops": MemoryConfig(policy="selective", granularity="ops"),
    "ops every_2": MemoryConfig(policy="selective", granularity="ops", layers="every_2"),
    "offload": MemoryConfig(policy="offload"),
    "full + offload": MemoryConfig(policy="full", offload=True),
    "attention + offload": MemoryConfig(policy="selective", granularity="attention", offload=True),
}


def _batch(vocab: int = 256, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    # two documents in row 0 (positions restart), one in row 1; some ignored labels
    pos = torch.cat([torch.arange(S // 2), torch.arange(S // 2)]).expand(B, S).clone()
    pos[1] = torch.arange(S)
    labels = ids.clone()
    labels[0, S // 2] = -100
    labels[1, :5] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def _grads(model: torch.nn.Module, memory: MemoryConfig, chunk_size: int = 0) -> tuple[torch.Tensor, dict]:
    apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
    model.train()
    loss = forward_loss_sum(model, _batch(), chunk_size)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def base():
    return make_llama(num_hidden_layers=3)


@pytest.fixture(scope="module")
def reference(base):
    model = clone_model(base)
    patch_attention(model, mode="packed_doc", backend="dense")
    return _grads(model, MemoryConfig())


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_gives_reference_grads(base, reference, name):
    model = clone_model(base)
    patch_attention(model, mode="packed_doc", backend="dense")
    loss, grads = _grads(model, POLICIES[name], chunk_size=37)  # chunked loss composes with every policy
    torch.testing.assert_close(loss, reference[0], rtol=1e-6, atol=1e-5)
    for n, g in reference[1].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=f"{name}: grad of {n}")


def test_policy_keeps_state_dict_keys(base):
    model = clone_model(base)
    keys = list(model.state_dict())
    apply_memory_policy(
        model, block_memory_specs(MemoryConfig(policy="full", offload=True), model.config.num_hidden_layers)
    )
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"policy": "sometimes"}, "memory.policy"),
        ({"policy": "full", "granularity": "mlp"}, "memory=selective"),
        ({"policy": "none", "offload": True}, "memory.offload"),
    ],
)
def test_memory_config_rejects(kwargs, match):
    with pytest.raises(UserError, match=match):
        MemoryConfig(**kwargs)


def test_auto_must_be_resolved_first():
    with pytest.raises(UserError, match="planner"):
        block_memory_specs(MemoryConfig(policy="auto"), 2)


def test_a_spec_per_block_is_required(base):
    with pytest.raises(ValueError, match="1 MemorySpecs for a model of 3 decoder blocks"):
        apply_memory_policy(clone_model(base), [MemorySpec(Recompute.BLOCK)])


def _train_flops(model: torch.nn.Module) -> int:
    model.train()
    batch = _batch()
    with FlopCounterMode(display=False) as counter:
        forward_loss_sum(model, batch).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("granularity", ["block", "attention", "mlp", "ops"])
def test_backward_flops_match_claimed_recompute(base, granularity):
    """FlopCounterMode counts matmuls (not the CPU flash-attention kernel): the extra FLOPs of a policy must be
    exactly the planner's recompute claim without the attention core."""
    plain = clone_model(base)
    patch_attention(plain, mode="packed_doc", backend="dense")
    policy = clone_model(base)
    patch_attention(policy, mode="packed_doc", backend="dense")
    layers = "every_2"
    memory = MemoryConfig(
        policy="full" if granularity == "block" else "selective", granularity=granularity, layers=layers
    )
    apply_memory_policy(policy, block_memory_specs(memory, policy.config.num_hidden_layers))
    extra = _train_flops(policy) - _train_flops(plain)
    shape = ModelShape.from_hf_config(base.config)
    claimed = len(select_layers(layers, shape.layers)) * recompute_flops_per_block(
        shape, Workload(B, S, 4, AttnBackend.DENSE), Recompute(granularity), count_attention_core=False
    )
    assert extra == claimed
    if granularity != "ops":
        assert extra > 0


@pytest.mark.parametrize("name", ["full", "attention", "mlp", "ops", "offload", "full + offload"])
def test_compiled_block_has_no_graph_break(base, reference, name):
    """fullgraph=True on aot_eager raises on any graph break; grads must still match eager."""
    torch._dynamo.reset()
    model = clone_model(base)
    patch_attention(model, mode="packed_doc", backend="dense")
    apply_memory_policy(model, block_memory_specs(POLICIES[name], model.config.num_hidden_layers))
    apply_compile(model, backend="aot_eager")  # the engine's path: every block fullgraph, its dynamo settings
    loss, grads = _grads(model, MemoryConfig())
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-4)
    for n, g in reference[1].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5, msg=f"{name}: grad of {n}")


def test_offload_never_copies_frozen_lora_base_weights():
    """LoRA freezes the base weights (requires_grad off); they stay resident and must not travel to the host."""
    from flexengine.core.config import LoraConfig, MemoryConfig
    from flexengine.surgery.attention import patch_attention
    from flexengine.surgery.lora import apply_lora
    from flexengine.surgery.loss import forward_loss_sum
    from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
    from flexengine.surgery.memory.meter import measure_activations
    from tests.helpers import make_llama

    offloaded = {}
    for r in (0, 4):
        model = make_llama()
        model.train()
        if r:
            model = apply_lora(model, LoraConfig(r=r))
        patch_attention(model, mode="packed_doc", backend="dense")
        apply_memory_policy(model, block_memory_specs(MemoryConfig(policy="offload"), model.config.num_hidden_layers))
        ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(128)[None]}
        report, _ = measure_activations(model, lambda model=model, batch=batch: forward_loss_sum(model, batch))
        offloaded[r] = report.as_dict()["activation_offloaded_bytes"]
    weight_bytes = sum(p.numel() * 4 for n, p in make_llama().named_parameters() if "layers" in n)
    assert offloaded[4] < offloaded[0] + weight_bytes / 10  # adapters add a little; base weights would add a lot
