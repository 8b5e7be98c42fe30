"""Executed FLOPs per useful token against the model's own count: what a planned step runs beyond the maths of
training on the corpus's tokens, by name.

The model's count (loop/flops.py's "model FLOPs", PaLM appendix B): every matmul's forward and input gradient,
and its weight gradient where the weight trains (6N per token in full fine-tuning; LoRA's frozen weights get none),
over the useful (non-padding) tokens, plus the attention core over the (query, key) pairs the mask allows within
the documents (4 FLOPs per pair, head and dim forward, 8 backward). What is executed is what the planner prices
(planner._step_time's FLOPs and the activation model's recompute): the same over every token slot, padding
included, attention over the padding's causal square too (packed_pairs lays it out as one more document), and the
forwards a checkpoint re-runs, and the chunked loss's lm_head forward, which its checkpointed chunks run again in
backward (loss.chunk_size below the predicting positions: 2 x hidden x vocab per token slot; loop/flops.py counts
the run's the same way; none in one piece, nor with loss.fused, whose forward computes the chunks' gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexengine.planning.activations import block_forward_flops, estimate_activations
from flexengine.planning.shapes import ModelShape, PlanInputs, rank_workload
from flexengine.surgery.attention.spec import AttentionSpec
from flexengine.surgery.memory.spec import MemorySpec

MATMULS = ("qkv_proj", "attn_out_proj", "gate_up_proj", "mlp_out_proj")


@dataclass(frozen=True)
class WorkPerToken:
    """FLOPs per useful token: the model's count, what the plan executes, and what the difference is made of."""

    model_flops: float  # 6N (4N + adapters under LoRA) plus the documents' attention pairs
    executed_flops: float
    padding_flops: float  # matmuls and attention over padding slots
    recompute_flops: float  # forwards a checkpoint re-runs in backward
    loss_recompute_flops: float  # lm_head's forward, re-run by the chunked loss's checkpointed chunks in backward
    fused_loss: bool = False  # loss.fused: the chunks' gradients come from the loss's forward (the table says so)

    @property
    def ratio(self) -> float:
        """Executed / model FLOPs."""
        return self.executed_flops / self.model_flops

    def to_json(self) -> dict:
        """The plan's JSON: every term and the ratio."""
        return {
            "model_flops": self.model_flops,
            "executed_flops": self.executed_flops,
            "ratio": self.ratio,
            "padding_flops": self.padding_flops,
            "recompute_flops": self.recompute_flops,
            "loss_recompute_flops": self.loss_recompute_flops,
        }

    def describe(self) -> str:
        """One line for the plan's table."""

        def share(flops: float) -> str:
            return f"{100 * flops / self.model_flops:+.1f} %"

        if self.loss_recompute_flops > 0:
            why = "the chunked loss re-runs lm_head's forward in backward"
        else:
            why = "fused loss: no re-run" if self.fused_loss else "the loss in one piece: no re-run"
        return (
            f"work: {self.ratio:.3f} x the model's FLOPs per useful token ({self.model_flops / 1e9:.1f} GFLOP: 6N + "
            f"attention pairs); padding {share(self.padding_flops)}, recompute {share(self.recompute_flops)}, loss "
            f"recompute {share(self.loss_recompute_flops)} ({why})"
        )


def document_pair_fractions(attention: AttentionSpec, rows: Sequence[Sequence[int]], seq_len: int) -> list[float]:
    """Per layer, the mean pairs its mask allows within the rows' documents (padding left out) / seq_len^2."""
    return [
        sum(mask.attended_pairs(list(row)) for row in rows) / max(1, len(rows)) / seq_len**2
        for mask in attention.layer_masks
    ]


def work_per_token(
    m: ModelShape, x: PlanInputs, specs: Sequence[MemorySpec], useful_fraction: float, document_pairs: Sequence[float]
) -> WorkPerToken:
    """The plan's FLOPs per useful token (module docstring) for PlanInputs `x` at the chosen micro-batch under the
    chosen per-block specs; useful_fraction: non-padding slots / all; document_pairs: `document_pair_fractions`."""
    w = rank_workload(x, max((spec.mlp_tile for spec in specs), default=0))
    executed_pairs = x.pairs.of_rank(x.cp)
    shares = executed_pairs if isinstance(executed_pairs, tuple) else (executed_pairs,) * m.layers
    passes = 2 + (1 if x.trainable_fraction >= 1.0 else 0)  # forward, input grad, weight grad where weights train
    forward = block_forward_flops(m, w, 1.0)
    per_token = (m.layers * sum(forward[k] for k in MATMULS) + 2 * w.tokens * m.hidden * m.vocab) / w.tokens
    attention_core = forward["attention_core"]  # at every pair of the row: scaled by each layer's share below
    useful = useful_fraction * w.tokens
    executed_attention = 3 * attention_core * sum(shares)
    model_attention = 3 * attention_core * sum(document_pairs) * x.cp
    recompute = estimate_activations(m, w, specs, attended_fraction=shares).recompute_flops
    chunks_rerun = w.loss_chunked and not w.fused_loss  # each chunk a checkpoint, unless fused or one piece
    loss_recompute = 2 * w.tokens * m.hidden * m.vocab if chunks_rerun else 0.0
    executed = passes * per_token * w.tokens + executed_attention + recompute + loss_recompute
    model = passes * per_token * useful + model_attention
    return WorkPerToken(
        model_flops=model / useful,
        executed_flops=executed / useful,
        padding_flops=(passes * per_token * (w.tokens - useful) + executed_attention - model_attention) / useful,
        recompute_flops=recompute / useful,
        loss_recompute_flops=loss_recompute / useful,
        fused_loss=w.fused_loss and w.loss_chunked,
    )
