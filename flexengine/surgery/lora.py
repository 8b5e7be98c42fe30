"""LoRA adapters through peft: wrap the model, save adapters, merge them into a plain HF state dict.

Applied right after loading, before attention patching, memory wrappers, compile and FSDP, so every later
step sees the adapted Linear layers like any other module. The merge works on a gathered full state dict
(plain tensors on rank 0), so it is the same code with or without FSDP.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Dict, Optional

import torch
from torch import nn

from flexengine.core.config import LoraConfig
from flexengine.core.errors import UserError
from flexengine.surgery.family import family_of

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; it appears in parameter names as `.lora_A.default.`
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\." + ADAPTER + r"\.weight$")


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """The peft model with LoRA adapters on lora.target_modules (null: the family's projections; base weights
    frozen); model itself if r=0."""
    if lora.r == 0:
        return model
    family = family_of(model)
    targets = family.lora_targets_of(lora.target_modules)
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    # plain LoRA only: merge_lora_state_dict folds W + (alpha / r) B A into Linear weights, nothing else
    config = PeftLoraConfig(
        r=lora.r,
        # peft annotates lora_alpha as int, but only divides by it (scaling = alpha / r): a float alpha works
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        use_rslora=False,
        use_dora=False,
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:  # peft names the missing modules
        raise UserError(f"model.lora.target_modules={targets}: {e}") from None
    not_linear = sorted(
        {
            name.split(".lora_")[0].removeprefix(_PEFT_PREFIX)
            for name, _ in peft_model.named_parameters()
            if ".lora_" in name and not _LORA_KEY.match(name)
        }
    )
    if not_linear:
        raise UserError(
            f"model.lora.target_modules={targets} puts adapters on {not_linear[:3]}, which are not Linear layers "
            "(e.g. the embedding); flexengine trains and merges Linear adapters only: target projections (null = "
            f"every projection of a {family.name} block: {', '.join(family.lora_targets)})."
        )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info(
        "lora: r=%d alpha=%g on %s: %.2fM trainable of %.1fM parameters",
        lora.r,
        lora.alpha,
        targets,
        trainable / 1e6,
        total / 1e6,
    )
    return peft_model


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a peft model (checkpoints then hold adapters, not the full weights)."""
    return hasattr(model, "peft_config")


def hf_key(peft_key: str) -> str:
    """A peft model's state-dict key -> the plain HF model's (and its checkpoint's) key for the same tensor."""
    return peft_key.replace(".base_layer.", ".").removeprefix(_PEFT_PREFIX)


def merge_lora_state_dict(
    state: Dict[str, torch.Tensor],
    lora: LoraConfig,
    exact_base: Optional[Callable[[str], Optional[torch.Tensor]]] = None,
) -> Dict[str, torch.Tensor]:
    """A peft model's full state dict -> the plain HF state dict with W + (alpha / r) * B @ A merged in.

    exact_base(hf key): the frozen tensor as the base checkpoint stores it, or None to take the state's. bf16 modes
    hold the frozen base in bf16 (precision.apply_precision): merging onto that copy would move every base weight of
    an fp32 checkpoint by its bf16 rounding (up to 2.4e-4 measured, 16 % of a LoRA update)."""
    scaling = lora.alpha / lora.r
    factors: Dict[str, Dict[str, torch.Tensor]] = {}
    merged: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _LORA_KEY.match(key)
        if match:
            factors.setdefault(match["module"], {})[match["ab"]] = value
        elif ".lora_" in key:  # embedding adapters, DoRA magnitudes, other adapter names: never copied as weights
            raise ValueError(
                f"cannot merge adapter tensor {key!r}: only Linear LoRA factors "
                f"(.lora_A/B.{ADAPTER}.weight) merge into base weights"
            )
        else:
            exact = exact_base(hf_key(key)) if exact_base is not None else None
            merged[key.replace(".base_layer.", ".")] = value if exact is None else exact
    # the export is in the adapters' (master) dtype: bf16 modes store the frozen base in bf16
    # (precision.apply_precision), and rounding W + dW to bf16 would lose most of a small LoRA update
    master = next((ab["A"].dtype for ab in factors.values()), None)
    if master is not None:
        merged = {k: v.to(master) if v.is_floating_point() else v for k, v in merged.items()}
    for module, ab in factors.items():
        weight_key = module + ".weight"
        delta = (ab["B"].float() @ ab["A"].float()) * scaling  # [out, r] @ [r, in]
        merged[weight_key] = (merged[weight_key].float() + delta).to(master)
    return {k.removeprefix(_PEFT_PREFIX): v for k, v in merged.items()}


def adapter_to_model_keys(adapter_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Saved adapter keys (`...lora_A.weight`) -> the peft model's own keys (`...lora_A.default.weight`)."""
    return {re.sub(r"\.lora_([AB])\.weight$", rf".lora_\1.{ADAPTER}.weight", k): v for k, v in adapter_state.items()}
