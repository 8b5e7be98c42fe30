"""First contact: `model.path=<pretrained checkpoint>` without a model group gets fine-tuning defaults.

The default model group is the tiny demo (conf/model/tiny.yaml), whose optimizer settings (lr 1e-3, weight decay
0.1, from conf/optim/adamw.yaml) train random weights from scratch; on pretrained weights they wreck the model in
a few hundred steps. A user who points model.path at a checkpoint and names no model group therefore gets the
fine-tuning defaults the shipped 7B model configs carry (lr, warmup, weight decay), plus their micro-batch and
accumulation when the checkpoint's parameter count says it is that size. Anything the user set
on the command line, or that a config of theirs changed from the schema's default, is kept; each default taken is
logged with the file it came from, and the run is named after the checkpoint directory, never "tiny".

Also two keys that exclude each other (optim.warmup_ratio and optim.warmup_steps), set by different sources: the
later one wins (later_setting_wins): a typed key over a config file's, debug=fast's warmup_steps over a 7B model
config's warmup_ratio.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from operator import attrgetter
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from flexengine.cli.config_sources import COMMAND_LINE, Layers, file_setting, last_setting
from flexengine.core.config import JobConfig, ModelConfig, conf_dir
from flexengine.core.config_record import FROM_COMMAND_LINE, ConfigRecord, from_config_file, nest

log = logging.getLogger(__name__)

DEMO_MODEL = "tiny"  # conf/config.yaml's default model group: what "no model group named" composes
# keys whose demo values are wrong for pretrained weights of any size: from the shipped model config of the
# checkpoint's size, else GENERIC_FINETUNE
FINETUNE_KEYS = ("optim.lr", "optim.warmup_ratio", "optim.weight_decay")
# what a pretrained model of a size no shipped config has gets (a 13B, a 1B): full fine-tuning values of the
# LLaMA family (lr 2e-5, no weight decay, 3 % of the steps warming up), as the shipped 7B configs carry them
GENERIC_FINETUNE = {"optim.lr": 2e-5, "optim.warmup_ratio": 0.03, "optim.weight_decay": 0.0}
GENERIC_SOURCE = "flexengine's generic fine-tuning defaults, first_contact.GENERIC_FINETUNE"
# a LoRA run (model.lora.r > 0) trains only its low-rank adapters, which start at zero and need a larger step than a
# full fine-tune's 2e-5: QLoRA (Dettmers et al. 2023, appendix hyperparameters) trained 7B/13B adapters at 2e-4 and
# 33B/65B at 1e-4, and TRL's LoRA SFT examples use 2e-4; 1e-4 is the cautious end of that range for any size
LORA_LR = 1e-4
LORA_SOURCE = "the usual LoRA rate, first_contact.LORA_LR (model.lora.r > 0 trains the adapters only)"
# keys that depend on the model's size: taken only when the checkpoint is within SAME_SIZE of that config's
# (loss.chunk_size is not one: conf/loss/default.yaml already chunks the cross-entropy for any vocabulary)
SIZE_KEYS = ("train.micro_batch", "train.grad_accum")
# parameter-count ratio (either way) under which a shipped config counts as the checkpoint's size: the 7B configs
# (6.7-7.2B) cover 5.2B-9.4B (Llama-3-8B, Qwen2-7B, Gemma-7B), not Llama-2-13B (13.0B, 1.9x) nor a 3B
SAME_SIZE = 1.3
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def holds_weights(path: str) -> bool:
    """Whether a model directory has weight files (not just config.json: model.init=random benchmarks)."""
    return any(any(Path(path).glob(pattern)) for pattern in WEIGHT_FILES)


def format_params(params: int) -> str:
    """A parameter count as people say it: 6.74B, or 4.2M below a billion (a small model is not "0.00B")."""
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"


def config_json_params(config: dict) -> Optional[int]:
    """Parameters of a LLaMA-style decoder counted from its config.json numbers, as planning.shapes.ModelShape counts
    them but without torch or transformers (importing them takes 10-25 s on a loaded machine, and the run's first
    line must not wait for them); None when a dimension is missing or nested (a multimodal text_config). The biases
    a family always carries whatever its config says (Qwen2's q/k/v) are left out: under 0.01 % of a model, far
    inside SAME_SIZE."""
    dims = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")
    if not all(isinstance(config.get(key), int) and config[key] > 0 for key in dims):
        return None
    h, a, f, L, V = (config[key] for key in dims)
    k = config.get("num_key_value_heads") or a
    d = config.get("head_dim") or h // a
    per_layer = h * (a * d + 2 * k * d) + a * d * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; two norms
    if config.get("attention_bias"):  # q, k, v and o
        per_layer += a * d + 2 * k * d + h
    embeddings = V * h * (1 if config.get("tie_word_embeddings") else 2)  # absent: untied, the LLaMA classes' default
    return L * per_layer + embeddings + h  # + the final norm


def _counted_params(model: ModelConfig) -> int:
    """model's parameter count: from config.json arithmetic (model.path) or model.arch when they hold every
    dimension, else through its HF config (importing torch and transformers)."""
    if model.path is not None:  # its files checked first: a damaged one stops here, before any heavy import
        from flexengine.surgery.model_files import check_model_dir, read_config_json

        counted = config_json_params(read_config_json(check_model_dir(str(model.path), model.loads_weights)))
    else:
        counted = config_json_params(dict(model.arch))
    if counted is not None:
        return counted
    from flexengine.planning.shapes import ModelShape
    from flexengine.surgery.model import build_hf_config

    return ModelShape.from_hf_config(build_hf_config(model)).params


def _shipped_finetune_configs() -> list[tuple[str, dict, int]]:
    """(file, yaml, parameter count) of every shipped model config that carries fine-tuning defaults."""
    out = []
    for path in sorted((conf_dir() / "model").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if "optim" not in raw or "arch" not in raw.get("model", {}):
            continue
        params = _counted_params(ModelConfig(init="random", arch=raw["model"]["arch"]))
        out.append((f"conf/model/{path.name}", raw, params))
    return out


def _yours(job: JobConfig, key: str, explicit: set[str]) -> bool:
    """Whether the user set key: typed, or changed from the schema's default by a config of theirs."""
    return key in explicit or attrgetter(key)(job) != attrgetter(key)(JobConfig())


def _step_count_note(job: JobConfig, explicit: set[str]) -> str:
    """train.max_steps is kept, never taken from a 7B config (the step count follows the user's data, not the model's
    size), but the demo's count is one of the settings that wreck a 7B run: say so where the defaults are listed."""
    steps = job.train.max_steps
    if _yours(job, "train.max_steps", explicit):
        return f"train.max_steps={steps} (yours)"
    return f"train.max_steps={steps} (kept: the demo's; set it for your data)"


def apply_pretrained_defaults(
    job: JobConfig, explicit: Iterable[str] = (), record: Optional[ConfigRecord] = None
) -> JobConfig:
    """The job with fine-tuning defaults when model.path holds pretrained weights and the model group is the demo's
    (see the module docstring); unchanged otherwise. explicit: the keys the command line typed (those are kept);
    record: takes each value changed, labelled first-contact with the file it came from."""
    model = job.model
    if model.name != DEMO_MODEL or not model.loads_weights or not holds_weights(str(model.path)):
        return job
    params = _counted_params(model)
    source, raw, source_params = min(_shipped_finetune_configs(), key=lambda c: abs(math.log(c[2] / params)))
    explicit = set(explicit)
    notes = [f"model.name={Path(str(model.path)).name} (the directory name of model.path)"]
    rows_kept: dict = {}
    if max(params, source_params) / min(params, source_params) <= SAME_SIZE:
        defaults = {key: raw[key.split(".")[0]].get(key.split(".")[1]) for key in FINETUNE_KEYS + SIZE_KEYS}
        defaults = {k: v for k, v in defaults.items() if v is not None}
        rows_kept = _rows_kept(job, explicit, defaults, source, notes)
    else:
        notes.append(
            f"{format_params(params)} parameters: no shipped model config is within {SAME_SIZE}x of that size "
            f"(nearest: {source}, {format_params(source_params)}), so generic fine-tuning defaults apply and "
            f"{_whose_rows(job, explicit)} stay"
        )
        defaults, source = dict(GENERIC_FINETUNE), GENERIC_SOURCE
    others = {k: v for k, v in defaults.items() if k not in rows_kept}
    sources = dict.fromkeys(others, source)
    if model.lora.r > 0 and "optim.lr" in others:  # adapters from zero: a full fine-tune's lr barely moves them
        others["optim.lr"], sources["optim.lr"] = LORA_LR, LORA_SOURCE
    changes = {**_taken_defaults(job, explicit, others, sources, notes), **rows_kept}
    notes.append(_step_count_note(job, explicit))
    log.warning(
        "model.path=%s holds pretrained weights (%s parameters) and no model group is named, so fine-tuning "
        "defaults replace the demo's from-scratch settings (model=%s: lr %g, weight decay %g) wherever you set "
        "none; yours are kept. Name a model group (model=deepseek7b, ...) or set any of these keys to choose "
        "yourself:\n  %s",
        model.path,
        format_params(params),
        DEMO_MODEL,
        JobConfig().optim.lr,  # the demo's values (conf/optim/adamw.yaml = the schema's), not the job's
        JobConfig().optim.weight_decay,
        "\n  ".join(notes),
    )
    replaced = {g: dataclasses.replace(getattr(job, g), **fields) for g, fields in nest(changes).items()}
    job = dataclasses.replace(job, model=dataclasses.replace(model, name=Path(str(model.path)).name), **replaced)
    if record is not None:
        labels = {key: f"first-contact: from {sources.get(key, source)}" for key in changes}
        record.update(job, {**labels, "model.name": "first-contact: model.path's directory name"})
    return job


def _whose_rows(job: JobConfig, explicit: set[str]) -> str:
    """train.micro_batch and train.grad_accum, each said to be the user's (typed, or changed from the demo's by a
    config of theirs) or the demo's."""
    whose = {True: "(yours)", False: "(the demo's)"}
    return " x ".join(f"{key}={attrgetter(key)(job)} {whose[_yours(job, key, explicit)]}" for key in SIZE_KEYS)


def _rows_kept(job: JobConfig, explicit: set[str], defaults: dict, source: str, notes: list[str]) -> dict:
    """train.micro_batch typed alone on a model of a shipped config's size: its grad_accum follows, so that the
    config's rows per optimizer step stay (the effective batch is what a fine-tuning recipe means)."""
    if not micro_batch_typed_alone(explicit) or "train.micro_batch" not in defaults:
        return {}
    micro = job.train.micro_batch
    accum, rows = accumulation_keeping_rows(defaults["train.micro_batch"], defaults.get("train.grad_accum", 1), micro)
    notes.append(
        f"train.grad_accum={accum} (keeps {source}'s {rows} rows per optimizer step at your train.micro_batch={micro}"
        + ("" if accum * micro == rows else f": {accum * micro}, the nearest")
        + "; type train.grad_accum to choose)"
    )
    return {"train.grad_accum": accum}


def micro_batch_typed_alone(explicit: set[str]) -> bool:
    """train.micro_batch typed without train.grad_accum: the user changed the micro-batch, not the effective batch
    (typing both keeps both as typed)."""
    return "train.micro_batch" in explicit and "train.grad_accum" not in explicit


def accumulation_keeping_rows(micro_batch: int, grad_accum: int, micro: int) -> tuple[int, int]:
    """(the grad_accum that keeps a config's micro_batch x grad_accum rows per optimizer step at micro-batch
    `micro` -- the nearest when micro does not divide them --, those rows)."""
    rows = micro_batch * grad_accum
    return max(1, round(rows / micro)), rows


def _taken_defaults(
    job: JobConfig, explicit: set[str], defaults: dict, sources: dict[str, str], notes: list[str]
) -> dict:
    """Of the defaults (sources: where each comes from), those the job takes: not a key the user set (typed, or
    changed from the schema's default by a config of theirs), nor a warmup ratio where a warmup step count is
    set. Each one noted."""
    changes = {}
    for key, value in defaults.items():
        if _yours(job, key, explicit):
            notes.append(f"{key}={attrgetter(key)(job)} (yours)")
        elif key == "optim.warmup_ratio" and job.optim.warmup_steps is not None:
            notes.append(f"optim.warmup_steps={job.optim.warmup_steps} (yours)")
        else:
            changes[key] = value
            notes.append(f"{key}={value} (from {sources[key]})")
    return changes


def keep_rows_per_step(job: JobConfig, explicit: set[str], layers: Layers) -> JobConfig:
    """train.micro_batch typed alone, over a config file's micro_batch x grad_accum (a 7B experiment's 1 x 8): the
    accumulation follows, so the file's rows per optimizer step stay (logged; typing train.grad_accum too keeps
    both as typed)."""
    accum_from = file_setting("train.grad_accum", layers)
    if not micro_batch_typed_alone(explicit) or accum_from is None:
        return job
    micro_from = file_setting("train.micro_batch", layers)
    file_micro = micro_from[2] if micro_from else JobConfig().train.micro_batch
    micro = job.train.micro_batch
    accum, rows = accumulation_keeping_rows(file_micro, accum_from[2], micro)
    if accum == job.train.grad_accum and accum * micro == rows:
        return job
    log.warning(
        "train.micro_batch=%d typed alone: train.grad_accum %d -> %d keeps the %d rows per optimizer step of %s "
        "(micro_batch %d x grad_accum %d)%s; type train.grad_accum to choose",
        micro,
        job.train.grad_accum,
        accum,
        rows,
        accum_from[1],
        file_micro,
        accum_from[2],
        "" if accum * micro == rows else f" as near as {micro} divides them: {accum * micro}",
    )
    return dataclasses.replace(job, train=dataclasses.replace(job.train, grad_accum=accum))


# keys that exclude each other (JobConfig refuses both set): of two set by different sources, the later one wins
# (a 7B model config warms up by optim.warmup_ratio, debug=fast and a user's older experiment by optim.warmup_steps)
EXCLUSIVE_KEYS = (("optim.warmup_ratio", "optim.warmup_steps"),)


def later_setting_wins(cfg: Any, layers: Layers) -> dict[str, str]:
    """Null, in the composed DictConfig cfg, the earlier-set key of two that exclude each other, both set (logged):
    the command line's over any config file's, a later file's in the defaults order over an earlier one's. Both
    typed, or both from one file, stay JobConfig's error. Returns {nulled key: its source label, naming the key
    that excluded it and where that was set}."""
    from omegaconf import OmegaConf, read_write

    overruled = {}
    for pair in EXCLUSIVE_KEYS:
        found = [(key, last_setting(key, layers)) for key in pair if OmegaConf.select(cfg, key) is not None]
        setters = sorted(((at[0], key, at[1]) for key, at in found if at is not None))
        if len(setters) < 2 or setters[0][0] == setters[1][0]:
            continue  # both typed, both from one file, or a value no layer explains: JobConfig names the pair
        (_, earlier, early), (_, later, late) = setters
        log.info(
            "%s=%s (%s) wins over %s=%s (%s, composed before it)",
            later,
            OmegaConf.select(cfg, later),
            late,
            earlier,
            OmegaConf.select(cfg, earlier),
            early,
        )
        with read_write(cfg):
            OmegaConf.update(cfg, earlier, None)
        where = FROM_COMMAND_LINE if late == COMMAND_LINE else from_config_file(late)
        overruled[earlier] = f"{where} ({later} {'typed' if late == COMMAND_LINE else 'set'} there excludes it)"
    return overruled
