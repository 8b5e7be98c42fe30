"""First contact: `model.path=<pretrained checkpoint>` without a model group gets fine-tuning defaults.

The default model group is the tiny demo (conf/model/tiny.yaml), whose optimizer settings (lr 1e-3, weight decay
0.1, from conf/optim/adamw.yaml) train random weights from scratch; on pretrained weights they wreck the model in
a few hundred steps. A user who points model.path at a checkpoint and names no model group therefore gets the
fine-tuning defaults the shipped 7B model configs carry (lr, warmup, weight decay), plus their micro-batch and
accumulation when the checkpoint's parameter count says it is that size. Anything the user set
on the command line, or that a config of theirs changed from the schema's default, is kept; each default taken is
logged with the file it came from, and the run is named after the checkpoint directory, never "tiny".

Also the command line's word against a config file's: of two keys that exclude each other (optim.warmup_ratio and
optim.warmup_steps), the one typed wins over the other set by a model or experiment config (command_line_wins).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from flexengine.core.config import JobConfig, ModelConfig, conf_dir
from flexengine.core.config_record import ConfigRecord

log = logging.getLogger(__name__)

DEMO_MODEL = "tiny"  # conf/config.yaml's default model group: what "no model group named" composes
# keys whose demo values are wrong for pretrained weights of any size (taken from a shipped 7B model config)
FINETUNE_KEYS = ("optim.lr", "optim.warmup_steps", "optim.weight_decay")
# keys that depend on the model's size: taken only when the checkpoint is within SAME_SIZE of that config's
# (loss.chunk_size is not one: conf/loss/default.yaml already chunks the cross-entropy for any vocabulary)
SIZE_KEYS = ("train.micro_batch", "train.grad_accum")
SAME_SIZE = 2.0  # parameter-count ratio (either way) under which two models count as the same size class
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def holds_weights(path: str) -> bool:
    """Whether a model directory has weight files (not just config.json: model.init=random benchmarks)."""
    return any(any(Path(path).glob(pattern)) for pattern in WEIGHT_FILES)


def command_line_keys(overrides: Iterable[str]) -> set[str]:
    """The dotted keys a list of Hydra overrides sets (`optim.lr=1e-4`, `+train.x=1`; group choices too)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def _shipped_finetune_configs() -> list[tuple[str, dict, int]]:
    """(file, yaml, parameter count) of every shipped model config that carries fine-tuning defaults."""
    from flexengine.planning.shapes import ModelShape
    from flexengine.surgery.model import build_hf_config

    out = []
    for path in sorted((conf_dir() / "model").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if "optim" not in raw or "arch" not in raw.get("model", {}):
            continue
        arch = raw["model"]["arch"]
        params = ModelShape.from_hf_config(build_hf_config(ModelConfig(init="random", arch=arch))).params
        out.append((f"conf/model/{path.name}", raw, params))
    return out


def _schema_default(group: str, key: str) -> Any:
    f = next(f for f in dataclasses.fields(type(getattr(JobConfig(), group))) if f.name == key)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _explain(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"


def _step_count_note(job: JobConfig, explicit: set[str]) -> str:
    """train.max_steps is kept, never taken from a 7B config (the step count follows the user's data, not the model's
    size), but the demo's count is one of the settings that wreck a 7B run: say so where the defaults are listed."""
    steps = job.train.max_steps
    if "train.max_steps" in explicit or steps != _schema_default("train", "max_steps"):
        return f"train.max_steps={steps} (yours)"
    return f"train.max_steps={steps} (kept: the demo's; set it for your data)"


def apply_pretrained_defaults(
    job: JobConfig, given: Iterable[str] = (), record: Optional[ConfigRecord] = None
) -> JobConfig:
    """The job with fine-tuning defaults when model.path holds pretrained weights and the model group is the demo's
    (see the module docstring); unchanged otherwise. given: the command line's overrides (those keys are kept);
    record: takes each value changed, labelled first-contact with the file it came from."""
    model = job.model
    if model.name != DEMO_MODEL or not model.loads_weights or not holds_weights(str(model.path)):
        return job
    from flexengine.planning.shapes import ModelShape
    from flexengine.surgery.model import build_hf_config

    params = ModelShape.from_hf_config(build_hf_config(model)).params
    source, raw, source_params = min(_shipped_finetune_configs(), key=lambda c: abs(math.log(c[2] / params)))
    same_size = max(params, source_params) / min(params, source_params) <= SAME_SIZE
    explicit = command_line_keys(given)
    changes: dict[str, dict] = {}
    notes = [f"model.name={Path(str(model.path)).name} (the directory name of model.path)"]
    for key in FINETUNE_KEYS + SIZE_KEYS:
        group, field = key.split(".")
        current = getattr(getattr(job, group), field)
        if key in SIZE_KEYS and not same_size:
            notes.append(f"{key}={current} (kept: {_explain(params)} parameters is not the size of {source})")
        elif key in explicit or current != _schema_default(group, field):
            notes.append(f"{key}={current} (yours)")
        elif key == "optim.warmup_steps" and job.optim.warmup_ratio is not None:
            notes.append(f"optim.warmup_ratio={job.optim.warmup_ratio} (yours)")
        else:
            value = raw[group][field]
            changes.setdefault(group, {})[field] = value
            notes.append(f"{key}={value} (from {source})")
    notes.append(_step_count_note(job, explicit))
    log.warning(
        "model.path=%s holds pretrained weights (%s parameters) and no model group is named, so the demo's "
        "from-scratch settings (model=%s: lr %g, weight decay %g) are replaced by fine-tuning defaults; name a "
        "model group (model=deepseek7b, ...) or set any of these keys to choose yourself:\n  %s",
        model.path,
        _explain(params),
        DEMO_MODEL,
        job.optim.lr,
        job.optim.weight_decay,
        "\n  ".join(notes),
    )
    groups = {g: dataclasses.replace(getattr(job, g), **fields) for g, fields in changes.items()}
    job = dataclasses.replace(job, model=dataclasses.replace(model, name=Path(str(model.path)).name), **groups)
    if record is not None:
        labels = {f"{g}.{f}": f"first-contact: from {source}" for g, fields in changes.items() for f in fields}
        record.update(job, {**labels, "model.name": "first-contact: model.path's directory name"})
    return job


def given_overrides(overrides: Optional[Iterable[str]]) -> list[str]:
    """The command line's overrides, or Hydra's record of them (None: inside a Hydra app, read from HydraConfig;
    outside one, nothing was given)."""
    if overrides is not None:
        return list(overrides)
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not inside a Hydra app
        return []


# keys that exclude each other (JobConfig refuses both set): the one typed on the command line wins over the other
# coming from a config file. Every shipped 7B model/experiment config sets optim.warmup_steps, which made
# optim.warmup_ratio=0.05 alone a refusal on exactly the models where it is wanted (review 22 #9).
EXCLUSIVE_KEYS = (("optim.warmup_ratio", "optim.warmup_steps"),)


def command_line_wins(cfg: Any, given: Iterable[str]) -> dict[str, str]:
    """Null, in the composed DictConfig cfg, a config file's key that a command-line key excludes (logged); both
    typed on the command line stay JobConfig's error. Returns {nulled key: the typed key that excluded it}."""
    from omegaconf import OmegaConf, read_write

    explicit = command_line_keys(given)
    overruled = {}
    for pair in EXCLUSIVE_KEYS:
        for mine, theirs in (pair, pair[::-1]):
            if mine not in explicit or theirs in explicit:
                continue
            mine_value, theirs_value = OmegaConf.select(cfg, mine), OmegaConf.select(cfg, theirs)
            if mine_value is None or theirs_value is None:
                continue
            log.info(
                "%s=%s (command line) wins over %s=%s (from a config file)", mine, mine_value, theirs, theirs_value
            )
            with read_write(cfg):
                OmegaConf.update(cfg, theirs, None)
            overruled[theirs] = mine
    return overruled
