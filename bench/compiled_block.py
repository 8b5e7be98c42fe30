"""What a compiled decoder block keeps for backward, against the planner's eager inventory (planning/activations.py).

MemTracker watches eager blocks only (a dispatch mode makes dynamo skip compiled frames), and the engine compiles
its blocks on a GPU (train.compile, and always under op-level SAC with flex). A compiled block's saved tensors are
what AOT autograd's partitioner chooses -- inductor's min-cut partitioner, which recomputes cheap pointwise
outputs in backward rather than keep them. So the block is compiled here with a backend that runs that partitioner
and records the forward graph's saved outputs (no inductor code generation: seconds on CPU). A small LLaMA block
(S tokens distinct from every model dimension, so a saved tensor with a token axis is an activation and one
without is a weight cast) with the engine's surgery: the precision's dtype and compute context, the flex attention
patch (flex inside the compiled block, as on a GPU), the memory policy. Used by bench/planner_vs_memtracker.py and
tests/planning/test_planner_vs_memtracker.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from transformers import LlamaConfig, LlamaForCausalLM

from flexengine.planning.activations import block_bytes
from flexengine.planning.shapes import ModelShape, Workload
from flexengine.surgery.applied import applied
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.compile import apply_compile
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
from flexengine.surgery.precision import SPECS

SMALL = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=4, vocab_size=512)
TOKENS = 1024  # no model dimension equals it


class SavedRecorder:
    """An AOT backend that partitions like inductor and records each forward graph's saved tensors."""

    def __init__(self) -> None:
        self.graphs: list[list[tuple[tuple, torch.dtype, int, bool]]] = []
        self.backend = aot_autograd(
            fw_compiler=self._forward,
            bw_compiler=lambda gm, inputs: gm,
            partition_fn=min_cut_rematerialization_partition,
        )

    def _forward(self, gm: Any, inputs: list) -> Any:
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved = []
        for node in outputs[1:]:  # the block's own output first, then what backward reads
            value = node.meta.get("val") if hasattr(node, "meta") else None
            if isinstance(value, torch.Tensor):
                nbytes = value.numel() * value.element_size()
                saved.append((tuple(value.shape), value.dtype, nbytes, node.op == "placeholder"))
        self.graphs.append(saved)
        return gm


# Another small width, every dimension changed (head dim too), and the README's 7B width at 8K rows: the
# compiled block's saved tensors at SMALL, each dimension mapped, give their bytes at another width (its_dims).
SMALL_2 = dict(hidden_size=384, intermediate_size=1032, num_attention_heads=4, num_key_value_heads=4, vocab_size=512)
WIDTH_7B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32)
TOKENS_2, TOKENS_7B = 1536, 8192
# The compiled block's offloaded bytes against the planner's (its eager inventory): never above them (the plan
# would under-count the host and the PCIe traffic), at most 15 % below (the partitioner recomputes cheap pointwise
# outputs the eager inventory keeps; 0.92 at 7B width, 8K rows).
COMPILED_OFFLOAD_TOLERANCE = (0.85, 1.0)


def its_dims(arch: dict, tokens: int) -> tuple[int, ...]:
    """(tokens, hidden, intermediate, heads, head dim) of a width: the sizes a block's saved tensors are made of."""
    heads = arch["num_attention_heads"]
    return tokens, arch["hidden_size"], arch["intermediate_size"], heads, arch["hidden_size"] // heads


def saved_in_block(precision: str, policy: Any, backend: str = "flex", arch: dict = SMALL, tokens: int = TOKENS):
    """One compiled block's forward under the engine's surgery: (what its forward graph saves, the model, the
    offload manager or None). A one-block model; flex traced inside the block as on a GPU."""
    spec = SPECS[precision]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**arch, num_hidden_layers=1, use_cache=False)).to(spec.param_dtype)
    patch_attention(model, mode="packed_doc", backend=backend, compile=False)
    apply_memory_policy(model, block_memory_specs(policy, model.config.num_hidden_layers))
    recorder = SavedRecorder()
    apply_compile(model, recorder.backend)
    model.train()
    ids = torch.randint(0, arch["vocab_size"], (1, tokens))
    batch = {"input_ids": ids, "position_ids": torch.arange(tokens)[None], "labels": ids}
    if backend == "varlen":  # one document per row: varlen's own path (cu_seqlens from the position ids)
        batch["document_ids"] = torch.zeros_like(ids)
    real_check = torch_flex._validate_device
    torch_flex._validate_device = lambda *args, **kwargs: None  # CPU flex refuses grad only for lack of a backward
    try:
        torch._dynamo.reset()
        with spec.compute_context(torch.device("cpu")):
            loss = forward_loss_sum(model, batch)
    finally:
        torch_flex._validate_device = real_check
    return recorder.graphs[0], model, applied(model).offload, loss


def kinds_of(saved: list, model, tokens: int, hidden: int) -> list[str]:
    """Each saved tensor's kind: "cast" (made by the graph, shaped like a weight: autocast's copy), "activation"
    (made by the graph otherwise, or the block's input among the graph's inputs), "input" (weights, the rotary
    tables, the mask: resident anyway, offload leaves them)."""
    weights = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    kinds = []
    for shape, _, _, is_input in saved:
        if is_input:
            kinds.append("activation" if shape == (1, tokens, hidden) else "input")
        else:
            kinds.append("cast" if shape in weights else "activation")
    return kinds


def _sums(saved: list, kinds: list[str]) -> tuple[int, int]:
    """(activation bytes, weight-cast bytes)."""
    acts = sum(b for (_, _, b, _), k in zip(saved, kinds) if k == "activation")
    return acts, sum(b for (_, _, b, _), k in zip(saved, kinds) if k == "cast")


def _planner_block(arch: dict, tokens: int, precision: str, model) -> tuple[int, int]:
    """The planner's (device, host) bytes of the block at this width and row length, for the model's policy."""
    spec = SPECS[precision]
    m = ModelShape.from_hf_config(LlamaConfig(**{**SMALL, **arch}, num_hidden_layers=1))
    w = Workload(1, tokens, spec.act_bytes, AttnBackend.FLEX, autocast=spec.autocast)
    return block_bytes(m, w, applied(model).memory[0])


def compiled_block_bytes(precision: str, policy: Any) -> dict[str, int]:
    """Bytes one compiled block keeps for backward ("compiled": the activations it makes, and its input when
    kept; "weight_casts": autocast's copies it keeps) beside the planner's eager per-block bytes, for a MemoryConfig
    applied to every block of a one-block model."""
    saved, model, _, _ = saved_in_block(precision, policy)
    activations, casts = _sums(saved, kinds_of(saved, model, TOKENS, SMALL["hidden_size"]))
    held, offloaded = _planner_block(SMALL, TOKENS, precision, model)
    return {"compiled": activations, "weight_casts": casts, "planner_eager": held + offloaded}


def offload_sees_what_compiled_keeps(precision: str, policy: Any, backend: str) -> dict[str, int]:
    """A compiled block with offload at SMALL width: the bytes its forward graph saves (activations), the bytes
    offload's pack hook sent to the host, and what the planner offloads per block."""
    saved, model, manager, _ = saved_in_block(precision, policy, backend)
    activations, _ = _sums(saved, kinds_of(saved, model, TOKENS, SMALL["hidden_size"]))
    _, planned = _planner_block(SMALL, TOKENS, precision, model)
    return {"compiled": activations, "to_host": manager.to_host_bytes, "planner_offloaded": planned}


def scaled_saved(saved: list, kinds: list[str], small: tuple[int, ...], big: tuple[int, ...]) -> list:
    """The saved activations and casts at another width: each dimension of SMALL's sizes (its_dims) mapped to the
    other's, a batch axis of 1 kept; a dimension that is none of them is an error (the mapping would be a guess).
    Graph inputs offload leaves (weights, rotary tables, the block mask) are not scaled: counted as 0 bytes."""
    to = dict(zip(small, big)) | {1: 1}
    out = []
    for (shape, dtype, _, is_input), kind in zip(saved, kinds):
        if kind == "input":
            out.append((shape, dtype, 0, is_input))
            continue
        missing = [d for d in shape if d not in to]
        if missing:
            raise ValueError(f"saved tensor {shape}: dimension(s) {missing} are none of {small}")
        new = tuple(to[d] for d in shape)
        out.append((new, dtype, math.prod(new) * dtype.itemsize, is_input))
    return out


def compiled_at_width(precision: str, policy: Any, arch: dict, tokens: int) -> dict[str, int]:
    """The compiled block's saved activation bytes at `arch` and `tokens`, derived from SMALL's compiled graph
    (scaled_saved), beside the planner's (device, host) bytes for the same block."""
    saved, model, _, _ = saved_in_block(precision, policy)
    kinds = kinds_of(saved, model, TOKENS, SMALL["hidden_size"])
    activations, casts = _sums(scaled_saved(saved, kinds, its_dims(SMALL, TOKENS), its_dims(arch, tokens)), kinds)
    held, offloaded = _planner_block(arch, tokens, precision, model)
    return {"compiled": activations, "weight_casts": casts, "planner_held": held, "planner_offloaded": offloaded}
