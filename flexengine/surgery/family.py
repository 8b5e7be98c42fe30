"""Model families: the one place that names an HF model's modules.

flexengine rewrites and counts a decoder through a few modules of each block: the attention and MLP sub-modules
(checkpointed alone by memory.granularity, tiled by memory.tiled_mlp, given a context-parallel flex call), their
projections (FLOPs, LoRA targets, the planner's adapter sizes) and the pre-norms in front of them (whether a
region's input carries a gradient). Each family's names live in one `Family` below; every other module asks
`family_of(model)` (or `resolve_family(hf_config)`) and never spells a module name itself, so a new family is one
entry in `FAMILIES` (tests/surgery/test_family.py checks both: the names exist on a tiny model of each family, and no
other module of the package holds them as string literals).

An unknown `model_type` is refused with a UserError, not guessed as LLaMA-shaped: a family that merely reuses the
LLaMA names can still differ where the names do not show it (Gemma-3: a norm after each sub-layer and one more
before the MLP, q/k norms, a query scale of its own; Gemma-2: logit soft-capping), and a guess would train with
FLOPs, memory plans or even attention numerics that no test of ours has checked. Adding the entry is the
deliberate step that says the family was checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, cast

from torch import nn
from transformers import PretrainedConfig

from flexengine.core.errors import UserError


class HFCausalLM(Protocol):
    """The methods of an HF causal LM that flexengine calls: transformers' PreTrainedModel has them, and peft's
    PeftModel (not a PreTrainedModel) forwards them to the model it wraps. tests/surgery/test_family.py checks that
    every family's model, and its peft wrapper, gives these types."""

    config: PretrainedConfig

    def get_decoder(self) -> nn.Module: ...

    def get_input_embeddings(self) -> nn.Embedding: ...  # PreTrainedModel says nn.Module: every family's is this

    def get_output_embeddings(self) -> nn.Module: ...

    def set_attn_implementation(self, attn_implementation: str) -> None: ...


def hf_causal_lm(model: nn.Module) -> HFCausalLM:
    """`model` typed as the HF causal LM (or peft wrapper of one) it is. torch types an nn.Module's other attributes
    as Tensor | Module, so `model.get_decoder()` does not type-check; this names the methods instead. A static
    view only (no check at run time: peft's forwarding is attribute lookup, which a Protocol check need not see)."""
    return cast(HFCausalLM, model)


@dataclass(frozen=True)
class Sublayer:
    """One half of a pre-norm decoder block: the norm in front of it, its sub-module and its projections."""

    norm: str  # the block's child whose output feeds this sub-layer
    module: str  # the block's child that is this sub-layer
    inputs: tuple[str, ...]  # projections reading the normalised input, in role order (attention: q, k, v; MLP:
    # gate, up) -- the planner sizes them by that order
    output: str  # the projection whose output joins the residual stream (attention: o; MLP: down)

    @property
    def projections(self) -> tuple[str, ...]:
        """Every Linear of the sub-layer: inputs, then the output projection."""
        return (*self.inputs, self.output)


@dataclass(frozen=True)
class Family:
    """How one HF model family names the modules flexengine rewrites or counts."""

    name: str
    model_types: tuple[str, ...]  # HF config.model_type values of this family
    attention: Sublayer
    mlp: Sublayer
    layers: str = "layers"  # get_decoder().<layers>: the ModuleList of decoder blocks
    final_norm: str = "norm"  # get_decoder().<final_norm>: the norm before the LM head
    input_biases: bool = False  # the attention's input projections always carry biases (Qwen2's q/k/v), whatever
    # config.attention_bias says (LLaMA's switch for q/k/v and o together)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """Default LoRA targets (model.lora.target_modules=null): every attention and MLP projection."""
        return (*self.attention.projections, *self.mlp.projections)

    def lora_targets_of(self, configured: Optional[Sequence[str]]) -> list[str]:
        """model.lora.target_modules as given, or this family's defaults when it is null."""
        return list(self.lora_targets if configured is None else configured)

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The model's list of decoder blocks."""
        lm = hf_causal_lm(model)
        layers = getattr(lm.get_decoder(), self.layers, None)
        if not isinstance(layers, nn.ModuleList):
            raise UserError(
                f"{type(model).__name__}: cannot find its decoder blocks (the {self.name} family keeps them at "
                f"get_decoder().{self.layers}); is model_type={lm.config.model_type!r} really this family?"
            )
        return layers

    def final_norm_of(self, model: nn.Module) -> Optional[nn.Module]:
        """The decoder's final norm (None if the model has none)."""
        return getattr(hf_causal_lm(model).get_decoder(), self.final_norm, None)


def _llama_named(name: str, *model_types: str, input_biases: bool = False) -> Family:
    """A family that uses LLaMA's module names (HF copies them into Mistral, Qwen2 and many more)."""
    return Family(
        name=name,
        model_types=model_types or (name,),
        attention=Sublayer("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
        mlp=Sublayer("post_attention_layernorm", "mlp", ("gate_proj", "up_proj"), "down_proj"),
        input_biases=input_biases,
    )


# One entry per family the tests run (attention against HF eager, FLOPs against FlopCounterMode, the planner).
LLAMA = _llama_named("llama")  # LLaMA 1-3 and DeepSeek-LLM (its config says model_type=llama)
MISTRAL = _llama_named("mistral")  # one sliding_window for every layer
QWEN2 = _llama_named("qwen2", input_biases=True)  # per-layer windows from layer_types (full vs sliding_attention)
FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2)


def resolve_family(hf_config: PretrainedConfig) -> Family:
    """The family of an HF config, from its model_type; a UserError for a family flexengine does not know."""
    model_type = getattr(hf_config, "model_type", None)
    family = next((f for f in FAMILIES if model_type in f.model_types), None)  # FAMILIES is the only table
    if family is None:
        supported = sorted(t for f in FAMILIES for t in f.model_types)
        raise UserError(
            f"model_type={model_type!r} is not a model family flexengine supports ({', '.join(supported)}). "
            "Use a model of one of these families, or add an entry for it to FAMILIES in flexengine/surgery/family.py "
            "(where its attention, MLP, projections and norms are named) and run tests/surgery/test_family.py."
        )
    return family


def family_of(model: nn.Module) -> Family:
    """The family of an HF model (peft-wrapped or not), from its config."""
    return resolve_family(hf_causal_lm(model).config)
