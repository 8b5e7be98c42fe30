"""The plan's inputs come from resolved specs: the AttentionSpec's mask modes count the attended pairs of packed rows
(per layer), the ParallelSpec's enums decide the reductions, and a plan with unknown documents counts each layer's
mask over one whole-row document and says so."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from flexengine.core.config import AttnConfig, JobConfig, MemoryConfig, ParallelConfig
from flexengine.core.parallel_spec import ReduceEvery, Strategy
from flexengine.loop.flops import attended_pairs, layer_attended_pairs
from flexengine.planning.fit import plan_specs
from flexengine.planning.planner import evaluate, plan_memory
from flexengine.planning.shapes import NO_CORPUS, AttendedPairs, ModelShape, PlanInputs
from flexengine.planning.specs import packed_pairs, plan_inputs, whole_row_pairs
from flexengine.surgery.attention import masks
from flexengine.surgery.attention.mask_mode import band_mode
from flexengine.surgery.attention.spec import resolve_attention_spec
from flexengine.surgery.precision import SPECS
from tests.helpers import A100, TINY_LLAMA
from tests.surgery.attention.test_mask_mode import PrefixLM

CONFIG = LlamaConfig(**TINY_LLAMA)
S = 512


def _spec(mode: str, window=None, config=CONFIG):
    return resolve_attention_spec(AttnConfig(mode=mode, backend="dense", window=window), config)


def _attention_s(x: PlanInputs, pairs: AttendedPairs) -> float:
    """Step seconds the attention core adds under these pairs (policy none: the step is compute alone)."""
    row = evaluate(ModelShape.from_hf_config(CONFIG), dataclasses.replace(x, pairs=pairs), MemoryConfig())
    none = evaluate(ModelShape.from_hf_config(CONFIG), dataclasses.replace(x, pairs=_zero()), MemoryConfig())
    return row.time.step_s - none.time.step_s


def _zero() -> AttendedPairs:
    return AttendedPairs((0.0,) * CONFIG.num_hidden_layers, "no attention")


def test_packed_pairs_count_each_layers_mask_over_the_rows_documents_and_padding():
    rows = [[300, 212], [6000 % S, 100], [S]]  # the second row ends in padding: one more document of its own
    pairs = packed_pairs(_spec("packed_doc"), rows, S, "three rows")
    causal = band_mode(True, None)
    expected = (causal.attended_pairs([300, 212]) + causal.attended_pairs([368, 100, 44]) + S * (S + 1) // 2) / 3
    assert pairs.fractions == (expected / S**2,) * CONFIG.num_hidden_layers
    assert pairs.source.startswith("three rows, counted for mode=packed_doc") and f"seq_len={S}" in pairs.source
    # a mode without documents masks the whole row as one (one document per row, its padding after it)
    whole = packed_pairs(_spec("causal"), [[300], [S]], S, "rows").fractions
    assert whole == (S * (S + 1) / 2 / S**2,) * CONFIG.num_hidden_layers
    # a sliding window counts its own band
    windowed = packed_pairs(_spec("packed_sliding", window=64), rows, S, "rows").fractions
    assert windowed is not None and windowed[0] < expected / S**2


def test_unknown_documents_count_each_layers_mask_over_one_whole_row():
    """No corpus: a causal layer keeps exactly the causal half; a windowed one is charged its band, per layer."""
    config = LlamaConfig(**TINY_LLAMA, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    pairs = whole_row_pairs(_spec("packed_sliding", config=config), S)
    assert pairs.fractions == ((64 * 65 // 2 + (S - 64) * 64) / S**2, 0.5)
    assert pairs.source.startswith(NO_CORPUS) and "window: 64 on 1 layer, none on 1 layer" in pairs.source
    assert f"seq_len={S}" in pairs.source
    assert whole_row_pairs(_spec("packed_doc"), S).fractions == (0.5,) * CONFIG.num_hidden_layers
    assert whole_row_pairs(_spec("causal"), S).of_rank(cp=4) == (2.0,) * CONFIG.num_hidden_layers
    # what the planner is handed: plan_specs without pairs, and packed_pairs of no rows
    job = JobConfig()
    job.data.seq_len = S
    assert plan_specs(job, config, _spec("packed_sliding", config=config)).pairs == pairs
    assert packed_pairs(_spec("packed_sliding", config=config), [], S, "none") == pairs


def test_packed_pairs_follow_each_layers_own_window():
    """A model whose layer_types window some layers: those layers' shares follow the window, the rest causal."""
    config = LlamaConfig(**TINY_LLAMA, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    spec = _spec("packed_sliding", config=config)
    fractions = packed_pairs(spec, [[S]], S, "one row").fractions
    assert fractions == (band_mode(True, 64).attended_pairs([S]) / S**2, S * (S + 1) / 2 / S**2)
    # per layer in the recompute too: recomputing only the windowed layer costs its window's attention, not causal's
    x = PlanInputs(seq_len=S, micro_batch=1, dtype_bytes=2, hardware=A100, pairs=AttendedPairs(fractions))
    m = ModelShape.from_hf_config(config)
    first = evaluate(m, x, MemoryConfig(policy="selective", granularity="attention", layers="0"))
    second = evaluate(m, x, MemoryConfig(policy="selective", granularity="attention", layers="1"))
    assert first.time.recompute_flops_fraction < second.time.recompute_flops_fraction


def test_planner_and_mfu_follow_a_new_mask_modes_own_pair_count(monkeypatch):
    """A per-document prefix-LM added to MODES alone: the planner's attention time and MFU's attention pairs both
    change from causal's by exactly the ratio of the mode's pairs to causal's."""
    monkeypatch.setitem(masks.MODES, "packed_prefix_lm", masks.ModeEntry(True, False, lambda window: PrefixLM(100)))
    prefix, causal = _spec("packed_prefix_lm"), _spec("packed_doc")
    rows = [[300, 212], [S]]  # no padding: the planner's documents are MFU's
    lengths = [n for row in rows for n in row]
    ratio = PrefixLM(100).pairs(300) + PrefixLM(100).pairs(212) + PrefixLM(100).pairs(S)
    ratio /= attended_pairs(lengths)
    assert ratio > 1  # the prefix sees itself both ways
    # MFU: the model FLOPs' pairs are the mode's own count
    layers = CONFIG.num_hidden_layers
    assert layer_attended_pairs(prefix, lengths, layers) == [round(ratio * attended_pairs(lengths))] * layers
    # the planner: the attention core's step time scales by the same ratio
    x = PlanInputs(seq_len=S, micro_batch=2, dtype_bytes=2, hardware=A100)
    planned = _attention_s(x, packed_pairs(prefix, rows, S, "prefix-LM rows"))
    assert planned > 0 and planned == pytest.approx(
        ratio * _attention_s(x, packed_pairs(causal, rows, S, "causal rows")), rel=1e-9
    )


def test_plan_says_where_its_pair_count_comes_from():
    x = PlanInputs(seq_len=S, micro_batch=1, dtype_bytes=2, hardware=A100, pairs=whole_row_pairs(_spec("causal"), S))
    unknown = plan_memory(CONFIG, x)
    assert unknown.attention_pairs.as_dict() == {
        "source": x.pairs.source,
        "fraction_of_row_squared": 0.5,
        "per_layer": [0.5] * CONFIG.num_hidden_layers,
    }
    packed = plan_memory(CONFIG, dataclasses.replace(x, pairs=packed_pairs(_spec("packed_doc"), [[100] * 5], S, "r")))
    assert (
        packed.attention_pairs.source.startswith("r, counted for")
        and packed.chosen.time.step_s < unknown.chosen.time.step_s
    )
    # a causal half per layer prices the step exactly as inputs built by hand without specs do
    assert (
        unknown.chosen.time.step_s
        == plan_memory(CONFIG, dataclasses.replace(x, pairs=AttendedPairs())).chosen.time.step_s
    )


def test_plan_inputs_read_the_resolved_specs():
    job = JobConfig(parallel=ParallelConfig(strategy="ddp", reduce_every="auto", mixed_precision=False))
    job.model.lora.r = 8
    specs = plan_specs(job, CONFIG, _spec("causal"))
    assert specs.parallel.strategy is Strategy.DDP and specs.parallel.reduce_every is ReduceEvery.WINDOW
    assert specs.lora_fraction is not None and 0 < specs.lora_fraction < 0.5
    x = plan_inputs(specs, dataclasses.replace(A100, world_size=2), SPECS["bf16_mixed"])
    assert x.reduce_every is ReduceEvery.WINDOW and x.trainable_fraction == specs.lora_fraction
    assert x.compute_copy_bytes > 0  # DDP never casts through FSDP's policy: autocast keeps its weight copies
    assert x.frozen_weight_bytes is not None and x.pairs == whole_row_pairs(specs.attention, specs.seq_len)
