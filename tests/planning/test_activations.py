"""The planner's activation bytes (flexengine/planning/activations.py) against the meter (CPU, dense and varlen
backends), against the closed-form per-layer formula, and its pointwise bytes against the ops HF runs."""

from __future__ import annotations

import pytest
import torch

from flexengine.core.config import MemoryConfig, ModelConfig
from flexengine.planning.activations import block_bytes, estimate_activations, memory_specs
from flexengine.planning.shapes import ModelShape, Workload
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy, measure_activations
from flexengine.surgery.memory.spec import MemorySpec
from flexengine.surgery.model import build_hf_config
from tests.helpers import clone_model, make_llama

MEASURED_POLICIES = [
    MemoryConfig(),
    MemoryConfig(policy="full"),
    MemoryConfig(policy="full", layers="every_2"),
    MemoryConfig(policy="selective", granularity="attention"),
    MemoryConfig(policy="selective", granularity="mlp"),
    MemoryConfig(policy="selective", granularity="ops"),
    MemoryConfig(policy="offload"),
    MemoryConfig(policy="full", offload=True),
]


@pytest.fixture(scope="module")
def small():
    return make_llama(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )


@pytest.mark.parametrize("B,S,chunk", [(1, 256, 0), (2, 384, 128), (1, 768, 0)])
def test_estimate_within_5_percent_of_meter(small, B, S, chunk):
    shape = ModelShape.from_hf_config(small.config)
    ids = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.arange(S).expand(B, S), "labels": ids}
    for memory in MEASURED_POLICIES:
        model = clone_model(small)
        patch_attention(model, mode="packed_doc", backend="dense")
        apply_memory_policy(model, memory_specs(memory, shape))
        model.train()
        report, _ = measure_activations(model, lambda model=model: forward_loss_sum(model, batch, chunk))
        est = estimate_activations(shape, Workload(B, S, 4, AttnBackend.DENSE, chunk), memory_specs(memory, shape))
        assert est.total_bytes == pytest.approx(report.total_bytes, rel=0.05), memory
        assert est.offloaded_bytes == pytest.approx(report.offloaded_bytes, rel=0.05), memory
        # The meter attributes a storage to the block that created it (each block makes the next one's input),
        # the planner to the block that keeps it: equal for a uniform policy's inner blocks.
        if memory.layers == "all" and memory.policy != "offload" and not memory.offload:
            assert est.per_block[1] == pytest.approx(report.per_block[1], rel=0.05), memory


@pytest.mark.parametrize("name", ["llama2_7b", "deepseek7b"])
def test_7b_none_matches_published_formula_adapted(name):
    """Korthikanti et al. per-layer bytes adapted to RMSNorm/SwiGLU/RoPE/GQA with flex attention (bf16). Flex returns
    its output in q's stride order, so o_proj's input is a view of it: no copy (bench/memtracker_standins.py's test).
    Under autocast over fp32 weights the residual stream and the normalised inputs stay fp32 and each of the five
    input projections keeps its own bf16 cast of its norm's output (MemTracker, bench/planner_vs_memtracker.py)."""
    import yaml

    from flexengine.core.config import conf_dir

    arch = yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text())["model"]["arch"]
    cfg = build_hf_config(ModelConfig(name=name, init="random", arch=arch))
    m = ModelShape.from_hf_config(cfg)
    s, b, h, a, k, f, p = 6144, 1, 4096, 32, 32, 11008, 2
    d = h // a
    formula = s * b * (2 * ((4 + 2 * p) * h + 4) + p * (2 * a * d + 2 * k * d) + 4 * a + 4 * p * f)
    assert block_bytes(m, Workload(b, s, p, AttnBackend.FLEX), MemorySpec())[0] == formula
    assert formula == pytest.approx(s * b * h * 45.5, rel=0.01)  # ~45.5 sbh vs 34 sbh for a GELU GPT block
    autocast = s * b * (2 * (8 * h + 4) + p * h * (3 + 2) + p * (2 * a * d + 2 * k * d) + 4 * a + 4 * p * f)
    assert block_bytes(m, Workload(b, s, p, AttnBackend.FLEX, autocast=True), MemorySpec())[0] == autocast
    # no S^2 term: doubling the sequence exactly doubles the block's bytes
    assert block_bytes(m, Workload(b, 2 * s, p, AttnBackend.FLEX), MemorySpec())[0] == 2 * formula
    assert m.params == pytest.approx({"llama2_7b": 6.74e9, "deepseek7b": 6.91e9}[name], rel=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_bytes_match_the_ops_hf_runs(small, dtype):
    """Bytes written by every non-matmul op of one decoder block's forward (a dispatch mode counts fresh output
    storages) against the planner's per-op derivation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flexengine.planning.activations import pointwise_bytes

    skip = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }

    class Written(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if func not in skip and func.overloadpacket is not torch.ops.aten.copy_:
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                        Written.total += t.numel() * t.element_size()
            return out

    B, S = 1, 256
    model = clone_model(small).to(dtype)
    model.set_attn_implementation("sdpa")
    layer = model.model.layers[0]
    hidden = torch.randn(B, S, 128, dtype=dtype)
    pos = torch.arange(S)[None]
    cos_sin = model.model.rotary_emb(hidden, pos)
    with Written():
        layer(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
    p = torch.empty((), dtype=dtype).element_size()
    expected = sum(
        pointwise_bytes(ModelShape.from_hf_config(small.config), Workload(B, S, p, AttnBackend.FLEX)).values()
    )
    assert expected == pytest.approx(Written.total, rel=0.02)


def test_varlen_estimate_matches_meter_and_keeps_less_than_dense(small):
    """The varlen backend saves what one SDPA call saves (no mask): planner == meter, and below the dense path."""
    B, S = 2, 384
    shape = ModelShape.from_hf_config(small.config)
    ids = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(150), torch.arange(S - 150)]).expand(B, S)  # two documents per row
    batch = {"input_ids": ids, "position_ids": positions, "labels": ids}
    measured = {}
    for backend in ("dense", "varlen"):
        model = clone_model(small)
        patch_attention(model, mode="packed_doc", backend=backend)
        model.train()
        report, _ = measure_activations(model, lambda model=model: forward_loss_sum(model, batch, 0))
        est = estimate_activations(
            shape, Workload(B, S, 4, AttnBackend(backend), 0), memory_specs(MemoryConfig(), shape)
        )
        assert est.total_bytes == pytest.approx(report.total_bytes, rel=0.05), backend
        measured[backend] = report.total_bytes
    assert measured["varlen"] < measured["dense"]
