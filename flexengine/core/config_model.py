"""The model.* schema: which causal LM to build (`ModelConfig`), its LoRA adapters and RoPE scaling; re-exported by
`config.py`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from flexengine.core.config_checks import MODEL_INITS, ROPE_SCALING_TYPES, check_arch_sizes, check_choice
from flexengine.core.errors import UserError


@dataclass
class RopeScalingConfig:
    """HF RoPE scaling (model.rope_scaling.*) for positions past the trained context; rope_type=null: none.

    E.g. model.rope_scaling={rope_type:yarn,factor:2.0}. Written into the HF config's rope_parameters before the
    model is built, so checkpoints (config.json) load the same way. Unset (null) keys take HF's defaults."""

    rope_type: Optional[str] = None  # null (no scaling) | linear | dynamic | yarn | llama3
    factor: float = 1.0  # supported context / trained context (>= 1)
    original_max_position_embeddings: Optional[int] = None  # yarn/llama3: trained context; null = the config's
    low_freq_factor: Optional[float] = None  # llama3 (required there; Llama-3.1 uses 1.0)
    high_freq_factor: Optional[float] = None  # llama3 (required there; Llama-3.1 uses 4.0)
    attention_factor: Optional[float] = None  # yarn: cos/sin scale; null = 0.1 ln(factor) + 1
    beta_fast: Optional[float] = None  # yarn: extrapolation boundary in rotations (HF default 32)
    beta_slow: Optional[float] = None  # yarn: interpolation boundary in rotations (HF default 1)

    def __post_init__(self) -> None:
        if self.rope_type is None:
            return
        check_choice("model.rope_scaling.rope_type", self.rope_type, ROPE_SCALING_TYPES)
        if self.factor < 1:
            raise UserError(
                f"model.rope_scaling.factor={self.factor} must be >= 1 (supported context / trained "
                f"context), e.g. model.rope_scaling={{rope_type:{self.rope_type},factor:2.0}}."
            )

    def as_hf(self) -> dict:
        """The keys HF's rope_parameters takes ({} without scaling)."""
        if self.rope_type is None:
            return {}
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class LoraConfig:
    """LoRA adapters through peft (model.lora.*); r=0 trains every weight instead."""

    r: int = 0  # adapter rank; 0 = full fine-tune (no adapters)
    alpha: float = 16.0  # scaling numerator: the update is (alpha / r) * B @ A
    dropout: float = 0.0  # dropout on the adapter input
    target_modules: Optional[List[str]] = None  # module-name suffixes that get adapters; null = every attention
    # and MLP projection of the model's family (flexengine.surgery.family: the names are the model's, not ours)

    def __post_init__(self) -> None:
        if self.r < 0:
            raise UserError(f"model.lora.r={self.r} must be >= 0 (0 = no LoRA, full fine-tune).")
        if self.r > 0 and self.target_modules is not None and not self.target_modules:
            raise UserError(
                "model.lora.target_modules is empty: name the Linear layers to adapt (suffixes of their module "
                "names), or leave it null for every attention and MLP projection of the model's family."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"model.lora.dropout={self.dropout} must be in [0, 1).")


@dataclass
class ModelConfig:
    """Which causal LM to train and how to build it."""

    name: str = "tiny"  # label used in logs and run names
    path: Optional[str] = None  # local HF directory (config.json, tokenizer, *.safetensors): its architecture
    # and weights are what trains; None = the architecture in `arch` with random weights
    init: str = "auto"  # auto: load `path`'s weights when given, else random | pretrained: `path` required |
    # random: random weights (architecture from `path` or `arch`), said loudly in the log
    arch: Dict[str, Any] = field(default_factory=dict)  # HF config fields used when `path` is None (needs model_type);
    # open-ended for the schema (the one group of keys of your choosing): any field of the family's HF config
    # class, as written; a key that class lacks is refused when the config is built (surgery.model.check_arch_fields)
    tokenizer: Optional[str] = None  # tokenizer directory; None = `path`, or the offline demo tokenizer without one
    trust_remote_code: bool = False  # only for model directories that ship their own modelling code
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (model.lora.r > 0) instead of full fine-tune
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # positions past the trained context
    allow_long_context: bool = False  # train documents longer than the (scaled) context anyway, positions untrained

    def __post_init__(self) -> None:
        check_choice("model.init", self.init, MODEL_INITS)
        if self.init == "pretrained" and self.path is None:
            raise UserError(
                f"model={self.name} loads pretrained weights, so model.path must name a local Hugging Face "
                "directory (config.json, tokenizer files, *.safetensors), e.g.\n"
                f"  python -m flexengine.train model={self.name} model.path=/models/deepseek-llm-7b-base\n"
                "or build the architecture with random weights (benchmarks): model.init=random"
            )
        if self.path is None and "model_type" not in self.arch:
            raise UserError(f"model={self.name}: without model.path, model.arch must give at least model_type.")
        check_arch_sizes(self.arch, "model.arch")

    @property
    def loads_weights(self) -> bool:
        """Whether the weights come from model.path (else they are initialised at random)."""
        return self.path is not None and self.init != "random"
