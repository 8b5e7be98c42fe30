"""FLOPs of a training step, counted the two ways the PaLM paper (appendix B) and torchtitan distinguish.

- **Model FLOPs** (for MFU): what the maths of one forward and backward needs, whatever the implementation:
  every matmul's forward, its input gradient where an input needs one, its weight gradient where the weight
  trains (LoRA: frozen weights get none, ~4N instead of 6N), over useful (non-padding) tokens; lm_head only at
  positions that predict a target; attention over the (query, key) pairs the mask allows (4 + 8 FLOPs per
  pair, head and dim).
- **Hardware FLOPs** (for HFU): what the device executes: padding too, the forwards that checkpointing re-runs
  (and the chunked loss's lm_head), attention as the backend runs it (flex: the BlockMask's computed blocks
  times block_size^2, i.e. the measured block density; dense: each chunk's query x key rectangle), and the
  flash-style backward that recomputes the scores (4 + 10 FLOPs per pair, head and dim).

The counts come from the model's own Linear modules (peft's adapters included), so LoRA, GQA and biases need no
special case. Which inputs need a gradient follows the data flow of a pre-norm decoder block; which parts a
recompute re-runs is `MemorySpec.recompute_flops` (surgery/memory/spec.py), the definition the planner prices too.
tests/loop/test_flops.py checks both counts against torch's FlopCounterMode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from flexengine.surgery.applied import applied
from flexengine.surgery.attention.mask_mode import band_mode
from flexengine.surgery.attention.spec import AttentionSpec
from flexengine.surgery.family import family_of
from flexengine.surgery.memory.spec import BlockFlops

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ATTN_MODEL_FLOPS = 4 + 8  # per (query, key) pair, head and head dim: QK^T and PV forward, twice that backward
ATTN_FWD_FLOPS = 4
ATTN_BWD_HW_FLOPS = 10  # flash/flex backward: recompute QK^T, then dV, dP, dQ, dK (FlopCounterMode's count)


@runtime_checkable
class _LanguageModel(Protocol):
    """What the counts read of a transformers model (a peft model forwards them to the model it wraps)."""

    config: PretrainedConfig

    def get_input_embeddings(self) -> nn.Module: ...

    def get_output_embeddings(self) -> Optional[nn.Module]: ...


@dataclass
class _Proj:
    """One projection (q_proj, down_proj, ...): its base Linear and LoRA factors, as (in x out) MACs/token."""

    base: int
    base_trains: bool
    lora_a: int = 0
    lora_b: int = 0
    lora_trains: bool = False

    @property
    def trains(self) -> bool:
        """Whether any of its weights has a gradient."""
        return self.base_trains or self.lora_trains

    def flops(self, input_grad: bool, forward_only: bool = False) -> float:
        """FLOPs per token: forward, plus (unless forward_only) input and weight gradients where needed."""
        fwd = 2 * (self.base + self.lora_a + self.lora_b)
        if forward_only:
            return fwd
        bwd = 2 * self.base * (input_grad + self.base_trains)
        # lora_B's input (lora_A's output) needs a grad when A trains or the projection's input needs one
        bwd += 2 * self.lora_a * (input_grad + self.lora_trains)
        bwd += 2 * self.lora_b * ((self.lora_trains or input_grad) + self.lora_trains)
        return fwd + bwd


def _linear(module: object, what: str) -> nn.Linear:
    """The module as the nn.Linear whose shape the counts read (quantised and float8 Linears subclass it)."""
    if not isinstance(module, nn.Linear):
        raise TypeError(f"FLOPs counting expects {what} to be an nn.Linear, got {type(module).__name__}")
    return module


def _linear_macs(linear: nn.Linear) -> int:
    return linear.in_features * linear.out_features


def _projection(module: nn.Module) -> _Proj:
    """A plain nn.Linear or a peft LoRA layer (base_layer + lora_A/lora_B dicts)."""
    base = _linear(getattr(module, "base_layer", module), "a projection")
    proj = _Proj(_linear_macs(base), base.weight.requires_grad)
    lora_a: Mapping[str, nn.Module] = getattr(module, "lora_A", None) or {}
    lora_b: Mapping[str, nn.Module] = getattr(module, "lora_B", None) or {}
    for name in lora_a:
        a, b = _linear(lora_a[name], "a LoRA factor"), _linear(lora_b[name], "a LoRA factor")
        proj.lora_a += _linear_macs(a)
        proj.lora_b += _linear_macs(b)
        proj.lora_trains |= a.weight.requires_grad or b.weight.requires_grad
    return proj


def _trains(module: Optional[nn.Module]) -> bool:
    return module is not None and any(p.requires_grad for p in module.parameters())


@dataclass
class _Region:
    """The attention or MLP half of one block: projections in, projection out, and gradient flags."""

    inputs: list[_Proj]
    output: _Proj
    input_grad: bool  # the region's (normalised) input needs a gradient
    inner_grad: bool  # the output projection's input needs a gradient

    def flops(self) -> float:
        """Forward + backward matmul FLOPs per token."""
        return sum(p.flops(self.input_grad) for p in self.inputs) + self.output.flops(self.inner_grad)

    @property
    def inputs_forward(self) -> float:
        """Forward FLOPs per token of the input projections."""
        return sum(p.flops(False, forward_only=True) for p in self.inputs)

    @property
    def output_end(self) -> float:
        """Forward FLOPs per token a checkpoint ending with this region re-runs of its output projection: its result
        is saved by nothing (a residual add follows), so only what a trainable LoRA factor after it saves
        (lora_A's output: base, then lora_A)."""
        return 2 * (self.output.base + self.output.lora_a) if self.output.lora_trains else 0.0


@dataclass
class _Block:
    attention: _Region
    mlp: _Region
    attention_backward: bool  # q/k/v need gradients, so the attention core runs backward

    @property
    def recompute_parts(self) -> BlockFlops:
        """Per token, the parts a recompute can re-run; the attention core is counted per layer from the mask's
        pairs instead (`TrainFlops.recompute_attention_layers`)."""
        return BlockFlops(
            attention_inputs=self.attention.inputs_forward,
            attention_core=0.0,
            attention_output=self.attention.output.flops(False, forward_only=True),
            mlp_inputs=self.mlp.inputs_forward,
            attention_output_end=self.attention.output_end,
            mlp_output_end=self.mlp.output_end,
        )


class TrainFlops:
    """Model and hardware FLOPs of micro-batches for one patched (possibly LoRA, checkpointed) model.

    What each block recomputes comes from the model's surgery record (`model.flexengine.memory`);
    chunk_size: loss.chunk_size (its checkpointed chunks re-run lm_head); fused: loss.fused (no re-run)."""

    def __init__(self, model: nn.Module, chunk_size: int = 0, fused: bool = False) -> None:
        if not isinstance(model, _LanguageModel):
            raise TypeError(f"TrainFlops counts a transformers (or peft) model, got {type(model).__name__}")
        cfg = model.config
        self.heads_dim = cfg.num_attention_heads * (
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.chunk_size, self.fused = chunk_size, fused
        embedding = model.get_input_embeddings().weight
        assert isinstance(embedding, torch.Tensor)  # an embedding's weight is a Parameter, never a submodule
        grad = embedding.requires_grad  # does the residual stream carry a grad?
        self.blocks: list[_Block] = []
        family = family_of(model)
        for layer in family.decoder_layers(model):
            regions = []
            for sub in (family.attention, family.mlp):
                parent = getattr(layer, sub.module)
                inputs = [_projection(getattr(parent, p)) for p in sub.inputs]
                output = _projection(getattr(parent, sub.output))
                input_grad = grad or _trains(getattr(layer, sub.norm, None))
                inner_grad = input_grad or any(p.trains for p in inputs)
                regions.append(_Region(inputs, output, input_grad, inner_grad))
                grad = grad or inner_grad or output.trains  # the residual after this region
            self.blocks.append(_Block(regions[0], regions[1], regions[0].inner_grad))
        head = _linear(model.get_output_embeddings(), "lm_head")
        self.head = _Proj(_linear_macs(head), head.weight.requires_grad)
        self.head_input_grad = grad or _trains(family.final_norm_of(model))
        self.recompute_per_token = 0.0
        self.recompute_attention_layers: list[int] = []  # blocks whose attention core backward re-runs
        for i, (block, spec) in enumerate(zip(self.blocks, applied(model).memory)):
            # per token, so tiled whenever a tile size is set (a micro-batch of one tile or less is not: overcounted)
            self.recompute_per_token += spec.recompute_flops(block.recompute_parts, mlp_tiled=spec.mlp_tile > 0)
            if spec.recompute.reruns_attention_core:
                self.recompute_attention_layers.append(i)

    @property
    def block_flops_per_token(self) -> float:
        """Forward + backward matmul FLOPs of all blocks for one token."""
        return sum(b.attention.flops() + b.mlp.flops() for b in self.blocks)

    @property
    def head_flops_per_token(self) -> float:
        """Forward + backward FLOPs of lm_head for one predicting position."""
        return self.head.flops(self.head_input_grad)

    def _per_layer(self, pairs) -> list:
        return list(pairs) if isinstance(pairs, (list, tuple)) else [pairs] * len(self.blocks)

    def _attention(self, pairs, backward_flops: int):
        """Attention core FLOPs; pairs: one count for every layer or a list per layer (a device tensor under
        flex: no host sync)."""
        total = 0.0
        for b, n in zip(self.blocks, self._per_layer(pairs)):
            total = total + n * self.heads_dim * (ATTN_FWD_FLOPS + (backward_flops if b.attention_backward else 0))
        return total

    def model_flops(self, useful_tokens: int, predicting: int, attended_pairs) -> float:
        """Model FLOPs of one micro-batch: useful tokens, predicting positions, attended (q, k) pairs summed over
        rows (per head; one count for every layer, or a list per layer when windows differ)."""
        attention = self._attention(attended_pairs, ATTN_MODEL_FLOPS - ATTN_FWD_FLOPS)
        return useful_tokens * self.block_flops_per_token + predicting * self.head_flops_per_token + attention

    def hardware_flops(self, token_slots: float, predicting: float, executed_pairs):
        """Hardware FLOPs of one micro-batch: every token slot (padding too), re-run forwards, and the (q, k)
        pairs the attention backend computes (per head, summed over rows; one count or a list per layer)."""
        flops = token_slots * (self.block_flops_per_token + self.recompute_per_token)
        flops += self._attention(executed_pairs, ATTN_BWD_HW_FLOPS)
        recomputed = self._per_layer(executed_pairs)
        flops += sum(recomputed[i] for i in self.recompute_attention_layers) * self.heads_dim * ATTN_FWD_FLOPS
        flops += predicting * self.head_flops_per_token
        return flops + self.loss_recompute_flops(predicting)

    def loss_recompute_flops(self, predicting: float) -> float:
        """lm_head's forward the chunked loss runs again in backward (each chunk a checkpoint) for a micro-batch of
        this many predicting positions; none for the fused loss, which computes the gradients in its forward."""
        if 0 < self.chunk_size < predicting and not self.fused:
            return predicting * self.head.flops(False, forward_only=True)
        return 0.0


def attended_pairs(lengths: list[int], window: Optional[int] = None) -> int:
    """(query, key) pairs a causal mask allows within documents of these lengths (window: keys per query at
    most, HF sliding_window semantics). Only for a model whose attention carries no AttentionSpec; otherwise
    `layer_attended_pairs` asks each layer's own mask mode."""
    return band_mode(True, window).attended_pairs(lengths)


def layer_attended_pairs(attn: Optional[AttentionSpec], lengths: list[int], n_layers: int) -> list[int]:
    """Per decoder layer, the (query, key) pairs its mask allows within documents of these lengths: the mask
    mode's own count (`AttentionSpec.attended_pairs`, any mode and window); without a spec (HF's attention,
    untouched) the causal count on every layer."""
    if attn is None:
        return [attended_pairs(lengths)] * n_layers
    return attn.attended_pairs(lengths)


def work_per_useful_token(
    flops: TrainFlops, summary: Mapping[str, float], micro_batch_slots: int
) -> Optional[dict[str, float]]:
    """A run's executed FLOPs per useful token against the model's own count (the summary's hardware and model
    FLOPs over its useful tokens), with the parts named: recompute (the forwards checkpoints re-ran, per token slot),
    the chunked loss's lm_head re-run (per useful token: about the predicting positions), and the rest, padding and
    attention as the backend runs it (flex's computed blocks, the flash backward's score recompute). None before any
    token trained. micro_batch_slots: train.micro_batch x data.seq_len."""
    useful, slots = summary["useful_tokens_seen"], summary["tokens_seen"]
    if not useful or not summary["model_flops"]:
        return None
    model, executed = summary["model_flops"] / useful, float(summary["hardware_flops"]) / useful
    recompute = flops.recompute_per_token * slots / useful
    predicting = micro_batch_slots * useful / slots  # a mean micro-batch's (about: its useful tokens)
    loss = flops.loss_recompute_flops(predicting) / predicting
    return {
        "model_flops": model,
        "executed_flops": executed,
        "ratio": executed / model,
        "recompute_flops": recompute,
        "loss_recompute_flops": loss,
        "padding_and_attention_flops": executed - model - recompute - loss,
    }
