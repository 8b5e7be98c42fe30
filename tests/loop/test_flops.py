"""Model and hardware FLOPs (flexengine.loop.flops) against torch's FlopCounterMode: packed, padded, LoRA and
checkpointed steps of a tiny LLaMA through the real patched forward and the real loss."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from flexengine.core.config import LoraConfig, MemoryConfig
from flexengine.data.packing import IGNORE_INDEX
from flexengine.data.targets import predicting_positions
from flexengine.loop.flops import TrainFlops, attended_pairs, layer_attended_pairs
from flexengine.surgery.attention import MASK_KWARG, mask_kwargs, patch_attention
from flexengine.surgery.lora import apply_lora
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
from tests.helpers import clone_model, make_llama

aten = torch.ops.aten
VOCAB = 512


def _forward_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


def _backward_without_recompute(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return 2 * sdpa_flop_count(q, k, v)  # dQ, dK, dV, dP: twice the forward (the model-FLOPs convention)


# torch has no formula for the CPU flash kernel the dense backend runs; these count its calls' real shapes.
HARDWARE = {
    aten._scaled_dot_product_flash_attention_for_cpu: _forward_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _backward_flops,
}
MODEL = {**HARDWARE, aten._scaled_dot_product_flash_attention_for_cpu_backward: _backward_without_recompute}


@pytest.fixture(scope="module")
def base():
    return make_llama(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )


def _rows(docs_per_row: list[list[int]], width: int) -> dict:
    """A batch like the loader's: documents back to back, padding its own document, -100 at starts and pads."""
    g = torch.Generator().manual_seed(0)
    B = len(docs_per_row)
    ids = torch.randint(1, VOCAB, (B, width), generator=g)
    labels = torch.full((B, width), IGNORE_INDEX)
    position_ids = torch.zeros(B, width, dtype=torch.long)
    document_ids = torch.zeros(B, width, dtype=torch.long)
    for r, docs in enumerate(docs_per_row):
        at = 0
        for d, n in enumerate(docs):
            labels[r, at + 1 : at + n] = ids[r, at + 1 : at + n]
            position_ids[r, at : at + n] = torch.arange(n)
            document_ids[r, at : at + n] = d
            at += n
        position_ids[r, at:] = torch.arange(width - at)
        document_ids[r, at:] = len(docs)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": position_ids,
        "document_ids": document_ids,
        "predicting_index": predicting_positions(labels),
        "useful_tokens": sum(map(sum, docs_per_row)),
        "document_lengths": [n for docs in docs_per_row for n in docs],
    }


def _model(base, mode="packed_doc", dense_chunk=512, memory=None, lora=None):
    model = clone_model(base)
    if lora is not None:
        model = apply_lora(model, lora)
    patch_attention(model, mode=mode, backend="dense", dense_chunk=dense_chunk)
    if memory is not None:
        apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
    return model.train()


def _counted(model, batch: dict, mapping: dict, chunk_size: int = 0) -> tuple[int, dict]:
    """FLOPs FlopCounterMode sees in one forward + backward of the training loss, and the mask kwargs used."""
    kwargs = mask_kwargs(model, batch["document_ids"])
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        forward_loss_sum(model, batch, chunk_size, **kwargs).backward()
    return counter.get_total_flops(), kwargs


def _claimed(model, batch: dict, kwargs: dict, chunk_size: int = 0, window=None) -> tuple:
    flops = TrainFlops(model, chunk_size)
    B, S = batch["input_ids"].shape
    predicting = len(batch["predicting_index"])
    model_flops = flops.model_flops(
        batch["useful_tokens"], predicting, attended_pairs(batch["document_lengths"], window)
    )
    return model_flops, flops.hardware_flops(B * S, predicting, kwargs[MASK_KWARG].executed_pairs)


PACKED = [[50, 19, 59], [128]]  # two rows of 128: three documents, then one
ONE_ROW = [[20, 9, 19]]  # dense_chunk=1 runs one SDPA call per query: kept short


def test_packed_hardware_flops_match_the_counter(base):
    model = _model(base, dense_chunk=32)
    batch = _rows(PACKED, 128)
    counted, kwargs = _counted(model, batch, HARDWARE)
    _, hardware = _claimed(model, batch, kwargs)
    assert hardware == pytest.approx(counted, rel=0.02)


def test_packed_model_flops_match_the_counter_when_only_attended_pairs_run(base):
    """dense_chunk=1 makes the backend compute exactly the pairs the mask allows: the counter (with the
    model convention's attention backward) must then agree with the model FLOPs."""
    model = _model(base, dense_chunk=1)
    batch = _rows(ONE_ROW, 48)
    counted, kwargs = _counted(model, batch, MODEL)
    model_flops, _ = _claimed(model, batch, kwargs)
    assert kwargs[MASK_KWARG].executed_pairs == [attended_pairs(batch["document_lengths"])] * 2  # per layer
    assert model_flops == pytest.approx(counted, rel=0.02)


def test_padded_rows_hardware_counts_padding_model_counts_documents(base):
    """One document per row padded to the longest (attn=causal, packing=none): hardware FLOPs are the padded
    batch's; model FLOPs are those of the documents run alone, unpadded."""
    model = _model(base, mode="causal", dense_chunk=16)
    lengths = (30, 48, 12)
    batch = _rows([[n] for n in lengths], 48)
    counted, kwargs = _counted(model, batch, HARDWARE)
    model_flops, hardware = _claimed(model, batch, kwargs)
    assert hardware == pytest.approx(counted, rel=0.02)
    alone = _model(base, mode="causal", dense_chunk=1)
    per_document = sum(_counted(alone, _rows([[n]], n), MODEL)[0] for n in lengths)
    assert model_flops == pytest.approx(per_document, rel=0.02)
    assert model_flops < 0.75 * hardware  # 90 of 144 slots are real


@pytest.mark.parametrize(
    "targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["q_proj", "v_proj"]]
)
def test_lora_counts_no_weight_gradients_for_frozen_weights(base, targets):
    lora = LoraConfig(r=8, alpha=16, target_modules=targets)
    batch = _rows(PACKED, 128)
    model = _model(base, dense_chunk=32, lora=lora)
    counted, kwargs = _counted(model, batch, HARDWARE)
    _, hardware = _claimed(model, batch, kwargs)
    assert hardware == pytest.approx(counted, rel=0.02)
    exact = _model(base, dense_chunk=1, lora=lora)
    one_row = _rows(ONE_ROW, 48)
    counted, kwargs = _counted(exact, one_row, MODEL)
    model_flops, _ = _claimed(exact, one_row, kwargs)
    assert model_flops == pytest.approx(counted, rel=0.02)
    full = TrainFlops(_model(base))
    assert TrainFlops(exact).block_flops_per_token < 0.75 * full.block_flops_per_token  # ~4N, not 6N


@pytest.mark.parametrize(
    "memory,lora,chunk_size",
    [
        (MemoryConfig(policy="full", layers="last_1"), None, 32),
        (MemoryConfig(policy="selective", granularity="attention"), None, 0),
        (MemoryConfig(policy="selective", granularity="mlp"), None, 0),
        (MemoryConfig(policy="selective", granularity="ops"), None, 0),
        (MemoryConfig(policy="none", tiled_mlp="32"), None, 0),
        (MemoryConfig(policy="full"), LoraConfig(r=8, alpha=16), 0),
        (MemoryConfig(policy="selective", granularity="attention"), LoraConfig(r=8, alpha=16), 0),
    ],
    ids=["full_last_1+chunked_loss", "attention", "mlp", "sac", "tiled_mlp", "full+lora", "attention+lora"],
)
def test_checkpointed_hardware_flops_include_recompute(base, memory, lora, chunk_size):
    batch = _rows(PACKED, 128)
    model = _model(base, dense_chunk=32, memory=memory, lora=lora)
    counted, kwargs = _counted(model, batch, HARDWARE, chunk_size)
    model_flops, hardware = _claimed(model, batch, kwargs, chunk_size)
    assert hardware == pytest.approx(counted, rel=0.02)
    plain = _model(base, dense_chunk=32, lora=lora)
    plain_model_flops, plain_hardware = _claimed(plain, batch, kwargs)
    assert model_flops == plain_model_flops  # recompute is hardware work, never model FLOPs
    if (memory.policy != "none" and memory.granularity != "ops") or chunk_size or memory.tiled_mlp:
        assert hardware > plain_hardware


def test_tiled_mlp_inside_a_block_checkpoint_recomputes_both(base):
    """Whole-block checkpointing over a tiled MLP: the block's re-run and then each tile's own checkpoint re-run
    gate/up (MemorySpec.recompute_flops). FlopCounterMode counts a little more still (some tiles' down_proj, ~1 %
    here); the block's re-run alone, as this counter once claimed, falls 10 % short."""
    batch = _rows(PACKED, 128)
    model = _model(base, dense_chunk=32, memory=MemoryConfig(policy="full", tiled_mlp="64"))
    counted, kwargs = _counted(model, batch, HARDWARE)
    _, hardware = _claimed(model, batch, kwargs)
    assert hardware == pytest.approx(counted, rel=0.02)


def test_planner_and_counter_price_recompute_with_one_definition(base, monkeypatch):
    """Which parts a recompute re-runs is defined once (surgery/memory/spec.py): the planner's estimate and this
    counter both go through it."""
    from flexengine.planning.activations import estimate_activations, memory_specs
    from flexengine.planning.shapes import ModelShape, Workload
    from flexengine.surgery.memory.spec import MemorySpec

    memory = MemoryConfig(policy="selective", granularity="attention")
    model = _model(base, memory=memory)
    shape = ModelShape.from_hf_config(base.config)
    monkeypatch.setattr(MemorySpec, "recompute_flops", lambda self, parts, mlp_tiled: 1000.0)
    assert TrainFlops(model).recompute_per_token == 1000.0 * shape.layers
    assert (
        estimate_activations(shape, Workload(1, 64), memory_specs(memory, shape)).recompute_flops
        == 1000.0 * shape.layers
    )


def test_sliding_window_pairs():
    assert attended_pairs([5], window=None) == 15
    assert attended_pairs([5], window=2) == 1 + 2 + 2 + 2 + 2
    assert attended_pairs([3, 4], window=8) == 6 + 10


def test_model_flops_follow_a_new_mask_modes_own_pair_count(base, monkeypatch):
    """A per-document prefix-LM added to MODES alone: MFU's pairs are that mode's count (its prefix sees itself both
    ways, so more pairs than causal), checked against its dense mask, and the model FLOPs' attention term follows."""
    from flexengine.core.config import AttnConfig
    from flexengine.surgery.attention import masks
    from flexengine.surgery.attention.spec import resolve_attention_spec
    from tests.surgery.attention.test_mask_mode import PrefixLM

    monkeypatch.setitem(masks.MODES, "packed_prefix_lm", masks.ModeEntry(True, False, lambda window: PrefixLM(16)))
    model = _model(base, dense_chunk=32)
    spec = resolve_attention_spec(AttnConfig(mode="packed_prefix_lm", backend="dense"), model.config)
    lengths = PACKED[0] + PACKED[1]
    q = torch.arange(max(lengths))[:, None]  # a document's own positions: keys kv <= q, or both in the prefix
    reference = sum(int(((q.T[:, :n] <= q[:n]) | ((q[:n] < 16) & (q.T[:, :n] < 16))).sum()) for n in lengths)
    pairs = layer_attended_pairs(spec, lengths, len(model.model.layers))
    assert pairs == [reference] * len(model.model.layers) and reference > attended_pairs(lengths)
    flops = TrainFlops(model, 0)
    extra = flops.model_flops(1, 1, pairs) - flops.model_flops(1, 1, attended_pairs(lengths))
    causal_attention = flops.model_flops(1, 1, attended_pairs(lengths)) - flops.model_flops(1, 1, 0)
    assert extra == pytest.approx(causal_attention * (reference / attended_pairs(lengths) - 1))


def test_the_fused_loss_counts_no_lm_head_rerun(base):
    """loss.fused computes each chunk's gradients in its forward: the counter sees lm_head's three matmuls once, and
    the chunked loss's count less its re-run (TrainFlops.loss_recompute_flops)."""
    batch = _rows(PACKED, 128)
    model = _model(base, dense_chunk=32)
    kwargs = mask_kwargs(model, batch["document_ids"])
    counted = {}
    for fused in (False, True):
        with FlopCounterMode(display=False, custom_mapping=HARDWARE) as counter:
            forward_loss_sum(model, batch, 32, fused, **kwargs).backward()
        counted[fused] = counter.get_total_flops()
    predicting = len(batch["predicting_index"])
    B, S = batch["input_ids"].shape
    chunked, fused = TrainFlops(model, 32), TrainFlops(model, 32, fused=True)
    assert fused.loss_recompute_flops(predicting) == 0 < chunked.loss_recompute_flops(predicting)
    executed = kwargs[MASK_KWARG].executed_pairs
    assert fused.hardware_flops(B * S, predicting, executed) == pytest.approx(counted[True], rel=0.02)
    assert counted[False] - counted[True] == chunked.loss_recompute_flops(predicting)
