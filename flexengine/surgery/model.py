"""Load an HF causal LM (local directory or random init from a config) and its tokenizer."""

from __future__ import annotations

import difflib
import logging
import os
import pickle
from pathlib import Path
from typing import Optional, cast

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from flexengine.core.config import ModelConfig
from flexengine.core.errors import UserError
from flexengine.data.demo import load_demo_tokenizer
from flexengine.surgery.family import hf_causal_lm, resolve_family
from flexengine.surgery.model_files import (
    StoredTensor,
    check_against_manifest,
    check_model_dir,
    check_shapes,
    read_config_json,
    stored_tensors,
    tokenizer_problem,
)
from flexengine.surgery.rope import apply_rope_scaling

log = logging.getLogger(__name__)


def build_hf_config(model: ModelConfig) -> PretrainedConfig:
    """The HF config of the model (from model.path/config.json or model.arch), with model.rope_scaling applied and
    use_cache off for training. A config.json that is not JSON, or weight files that are damaged (headers, index,
    sizes: cheap to read), fail here, before any tokenizing."""
    if model.trust_remote_code:
        log.warning(
            "model.trust_remote_code=true: Python code shipped in %s will run in this process; use it "
            "only for model directories you trust",
            model.path or model.tokenizer or "the model directory",
        )
    if model.path is not None:
        path = check_model_dir(model.path, model.loads_weights)
        check_remote_code(read_config_json(path), model)
        try:
            config = AutoConfig.from_pretrained(base_name_or_path(model), trust_remote_code=model.trust_remote_code)
        except (ValueError, OSError) as e:  # JSON, but not a config transformers knows (e.g. its model_type)
            raise UserError(
                f"model.path={model.path!r}: transformers cannot read its config.json: {e} Fix or "
                "replace the file (it must be the model's Hugging Face config)."
            ) from None
    else:
        arch = dict(model.arch)
        model_type = arch.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **arch)
        except ValueError:
            raise UserError(
                f"model.arch.model_type={model_type!r} is not a model family transformers knows "
                "(e.g. llama, mistral, qwen2)."
            ) from None
        check_arch_fields(arch, config)
    # A KV cache is useless in training, and with it on HF skips packed-sequence handling
    # (docs/architecture.md, "Facts").
    config.use_cache = False
    resolve_family(config)  # a family flexengine does not know fails here, before any tokenizing or allocating
    apply_rope_scaling(config, model.rope_scaling.as_hf())
    return config


def check_remote_code(config_json: dict, model: ModelConfig) -> None:
    """A config.json whose family transformers does not ship and that names its own Python code (auto_map) is
    refused in one paragraph unless model.trust_remote_code (transformers' own refusal linked to hf.co/<path>)."""
    from transformers import CONFIG_MAPPING

    code = config_json.get("auto_map")
    if model.trust_remote_code or not code or config_json.get("model_type") in CONFIG_MAPPING:
        return
    names = ", ".join(sorted(map(str, code.values() if isinstance(code, dict) else code)))
    raise UserError(
        f"model.path={model.path!r}: its config.json is of model_type {config_json.get('model_type')!r}, which "
        f"transformers does not ship, and names Python code in that directory to build it (auto_map: {names}). "
        "Loading it would run that code: if you trust the directory, set model.trust_remote_code=true (the "
        "family must still be one flexengine knows); otherwise use a model of a family transformers ships."
    )


def check_arch_fields(arch: dict, config: PretrainedConfig) -> None:
    """Refuse model.arch keys the family's HF config class does not know (UserError naming the nearest field):
    transformers keeps such a key as a plain attribute that no layer reads, so `num_hiden_layers=2` built the
    unchanged model without a word. Known: the class's own fields (its default to_dict()) and the keys it folds into
    others (rope_theta into rope_parameters: absent from the built config's to_dict())."""
    try:
        fields = set(type(config)().to_dict())
    except Exception:  # a family whose config class needs arguments: its fields cannot be listed, nothing checked
        return
    built = config.to_dict()
    unknown = [key for key in arch if key not in fields and key in built]
    if not unknown:
        return
    parts = []
    for key in unknown:
        near = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.6)
        parts.append(f"model.arch.{key}" + (f" (did you mean model.arch.{near[0]}?)" if near else ""))
    raise UserError(
        f"{', '.join(parts)}: not a field of transformers' {type(config).__name__} (model_type "
        f"{config.model_type}), so no layer would read it and the model would be built without it. Use the "
        f"config's field names ({type(config).__name__}().to_dict() lists them)."
    )


def base_name_or_path(model: ModelConfig) -> str:
    """model.path as an absolute path: what the loaded model's `name_or_path` says, which peft records as a LoRA
    adapter's base_model_name_or_path. The path as typed was relative to wherever the run was launched, so the
    adapter could not find its base from anywhere else. (Symlinks are kept: they are the user's names.)"""
    if model.path is None:
        raise ValueError(f"model={model.name} has no model.path (built from model.arch): it has no directory to name")
    return os.path.abspath(model.path)


def build_meta_model(config: PretrainedConfig, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """The full-size model on the meta device: shapes and dtypes without allocating a byte (plans, rehearsals)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def _n_params(lm: torch.nn.Module) -> int:
    return sum(p.numel() for p in lm.parameters())


def _built_from_config(
    model: ModelConfig, config: PretrainedConfig, device: torch.device, dtype: torch.dtype, placeholder: bool
) -> torch.nn.Module:
    """The architecture with fresh weights: random ones said loudly, or a rank's placeholders said as such."""
    with device:
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=model.trust_remote_code)
    source = f"{model.path}/config.json" if model.path else f"model.arch of model={model.name}"
    if placeholder:  # random values for the moment: not what trains, so no RANDOM warning
        log.info(
            "model %s: shapes built from %s (%s, %.1fM parameters, %s on %s); its weights come by broadcast "
            "from rank 0, which reads %s",
            model.name,
            source,
            config.model_type,
            _n_params(lm) / 1e6,
            dtype,
            device,
            model.path,
        )
        return lm
    log.warning(
        "model %s: RANDOM weights (model.init=%s), architecture from %s: %s, %.1fM parameters, %s on "
        "%s. Nothing pretrained is loaded%s.",
        model.name,
        model.init,
        source,
        config.model_type,
        _n_params(lm) / 1e6,
        dtype,
        device,
        "" if model.path else "; give model.path=<HF directory> to fine-tune real weights",
    )
    return lm


def load_model(
    model: ModelConfig, device: torch.device, dtype: torch.dtype = torch.float32, placeholder: bool = False
) -> torch.nn.Module:
    """Load model.path's architecture and weights (or build random weights when asked) on `device` in `dtype`.
    placeholder: build the shapes only; the weights of model.path come later by broadcast from rank 0 (a rank > 0
    of a job, which reads no checkpoint of its own)."""
    config = build_hf_config(model)
    if placeholder or not model.loads_weights:
        return _built_from_config(model, config, device, dtype, placeholder)
    assert model.path is not None  # loads_weights: weights come from model.path
    path = Path(model.path)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise UserError(f"model.path={model.path!r} holds no *.safetensors weights (use model.init=random for none).")
    lm, info, stored = _from_pretrained(model, config, dtype)
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # HF would initialise them at random and only warn
        raise UserError(
            f"model.path={model.path!r}: {len(missing)} weights of {type(lm).__name__} are not in the "
            f"checkpoint (e.g. {missing[:3]}); it is not a complete {config.model_type} checkpoint."
        )
    unexpected = len(info.get("unexpected_keys") or [])
    # the tensors of the files transformers read (their headers, read once before it); *.bin only: no header
    n_stored = len(stored) if stored is not None else len(lm.state_dict())
    lm = lm.to(device)
    check_finite_weights(lm, path)  # on the device: one fast pass there
    log.info(
        "model %s: loaded %d tensors from %s (%s, %.1fM parameters, %s on %s)%s",
        model.name,
        n_stored - unexpected,
        path,
        config.model_type,
        _n_params(lm) / 1e6,
        dtype,
        device,
        f"; {unexpected} tensors in the checkpoint were not used" if unexpected else "",
    )
    return lm


def check_finite_weights(lm: torch.nn.Module, path: Path) -> None:
    """Refuse weights that are NaN or Inf as stored (UserError naming them): otherwise the run's non-finite check
    would blame the first update. One pass over the weights, one host sync."""
    tensors = [(name, t) for name, t in lm.state_dict().items() if t.is_floating_point() and t.numel()]
    if not tensors:
        return
    finite = torch.stack([torch.isfinite(t).all() for _, t in tensors]).tolist()
    bad = [name for (name, _), ok in zip(tensors, finite) if not ok]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise UserError(
            f"model.path={str(path)!r}: {', '.join(bad[:3])}{more} hold NaN or Inf values as stored in {path}: "
            "these weights cannot train. Use an intact copy of the model (or an earlier checkpoint)."
        )


def _from_pretrained(
    model: ModelConfig, config: PretrainedConfig, dtype: torch.dtype
) -> tuple[torch.nn.Module, dict, Optional[dict[str, StoredTensor]]]:
    """transformers' from_pretrained after checking the files it will read: each weight file's header, a
    checkpoint's manifest, and every stored tensor's shape against config.json's architecture. Returns the model,
    its loading info and the stored tensors (None: *.bin weights, no header to read)."""
    assert model.path is not None  # only called to load weights, which come from model.path
    path = Path(model.path)
    stored = stored_tensors(path)
    if stored is not None:
        check_against_manifest(path, {t.file for t in stored.values()})
        meta = build_meta_model(config, dtype, model.trust_remote_code)
        check_shapes(stored, {k: tuple(v.shape) for k, v in meta.state_dict().items()}, path / "config.json")
    try:
        # output_loading_info=True returns (model, info); transformers' annotation knows only the model
        lm, info = cast(
            tuple[torch.nn.Module, dict],
            AutoModelForCausalLM.from_pretrained(
                base_name_or_path(model),
                config=config,
                dtype=dtype,
                trust_remote_code=model.trust_remote_code,
                use_safetensors=None,
                output_loading_info=True,
            ),
        )
        return lm, info, stored
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError, SafetensorError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        # what the checks above do not read: *.bin weights (torch's zip/pickle format), or a tensor's data bytes
        raise UserError(
            f"cannot load the weights in {path} (model.path): {type(e).__name__}: {' '.join(str(e).split())[:400]}"
        ) from None


def load_tokenizer(model: ModelConfig, cache_dir: Optional[Path] = None):
    """The tokenizer of model.tokenizer / model.path, or the offline demo tokenizer when neither is given."""
    source = model.tokenizer or model.path
    if source is None:
        return load_demo_tokenizer(cache_dir)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    except Exception as e:  # tokenizers raises plain Exception for a broken tokenizer.json
        raise UserError(tokenizer_problem(source, e) + ".") from None


def check_vocab(lm: torch.nn.Module, tokenizer) -> None:
    """Fail early if the tokenizer can emit ids the embedding does not have."""
    vocab = hf_causal_lm(lm).get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only {vocab}; "
            "use the model's own tokenizer (model.tokenizer) or a larger vocab_size."
        )
