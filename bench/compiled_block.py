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


def compiled_block_bytes(precision: str, policy: Any) -> dict[str, int]:
    """Bytes one compiled block keeps for backward ("compiled": the activations it makes, and its input when
    kept; "weight_casts": autocast's copies it keeps) beside the planner's eager per-block bytes, for a MemoryConfig
    applied to every block of a one-block model."""
    spec = SPECS[precision]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=1, use_cache=False)).to(spec.param_dtype)
    patch_attention(model, mode="packed_doc", backend="flex", compile=False)  # flex traced inside the block
    apply_memory_policy(model, block_memory_specs(policy, model.config.num_hidden_layers))
    recorder = SavedRecorder()
    apply_compile(model, recorder.backend)
    model.train()
    ids = torch.randint(0, SMALL["vocab_size"], (1, TOKENS))
    batch = {"input_ids": ids, "position_ids": torch.arange(TOKENS)[None], "labels": ids}
    real_check = torch_flex._validate_device
    torch_flex._validate_device = lambda *args, **kwargs: None  # CPU flex refuses grad only for lack of a backward
    try:
        torch._dynamo.reset()
        with spec.compute_context(torch.device("cpu")):
            forward_loss_sum(model, batch)
    finally:
        torch_flex._validate_device = real_check
    saved = recorder.graphs[0]
    hidden = (1, TOKENS, SMALL["hidden_size"])
    activations = sum(b for shape, _, b, is_input in saved if TOKENS in shape and (not is_input or shape == hidden))
    casts = sum(b for shape, _, b, is_input in saved if TOKENS not in shape and not is_input)
    m = ModelShape.from_hf_config(model.config)
    w = Workload(1, TOKENS, spec.act_bytes, AttnBackend.FLEX, autocast=spec.autocast)
    specs = applied(model).memory
    return {"compiled": activations, "weight_casts": casts, "planner_eager": block_bytes(m, w, specs[0])[0]}
