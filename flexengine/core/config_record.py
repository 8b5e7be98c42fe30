"""The record of one run's effective configuration: every value the run used, and where each one came from.

Hydra's `.hydra/config.yaml` is the config as *composed*; the run then changes some of it before training: the
first-contact defaults of a pretrained `model.path` (flexengine/cli/first_contact.py), the attention rules'
`data.packing=auto`, the hardware found at start-up, the planner's precision, memory policy and micro-batch
(flexengine/planning/fit.py), `train.epochs` turned into `train.max_steps`, and the attention backend `auto`
resolved. A `ConfigRecord` starts from the composed job, takes the job after each of those stages and attributes
every value that stage changed to it. summary.json["config"] / ["config_sources"] and `resolved_config.yaml` are
written from it, so what is saved is what trained.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any, Mapping, Union

from flexengine.core.storage import write_text_atomic

# Where a value came from: the first word is the kind (yours, config, default, first-contact, auto, given).
FROM_COMMAND_LINE = "yours: command line"
FROM_SCHEMA_DEFAULT = "default: schema"
FROM_CALLER = "given: the JobConfig handed to run_training"
AUTO_ATTENTION_RULES = "auto: attention rules (data.packing=auto follows attn.mode)"
AUTO_HARDWARE = "auto: hardware found at start-up"
AUTO_PLANNER = "auto: planner (flexengine-plan shows why)"
AUTO_EPOCHS = "auto: train.epochs over this data"
AUTO_ATTENTION_BACKEND = "auto: attention backend for this device and mode"
AUTO_ROW_LENGTH = "auto: row length over this corpus (the lengths weighed: the log, summary.json's data.row_length)"
# model.arch of a model.path run: config.json's fields are what trains (model.arch is not read with a path)
FROM_MODEL_PATH = "model.path: config.json"

RESOLVED_CONFIG_FILE = "resolved_config.yaml"


def from_config_file(path: str) -> str:
    """The source label of a value a config file set."""
    return f"config: {path}"


def _plain(value: Any) -> Any:
    """A config value as plain YAML/JSON data: dataclasses (data.mix's sources) become dicts, enums their values,
    paths strings (a JobConfig built in Python may hold a Path: YAML cannot write one)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return str(value) if isinstance(value, Path) else value


def flat_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> plain value of a config dataclass; nested config dataclasses are flattened, dict- and
    list-typed fields (model.arch, data.mix) stay one value each, as the schema declares them. Fields outside
    the schema (omegaconf_ignore: hardware.speed, a measurement) are no config and stay out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.metadata.get("omegaconf_ignore"):
            continue
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(flat_config(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = _plain(value)
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"optim.lr": 1e-3} -> {"optim": {"lr": 1e-3}} (the shape of dataclasses.asdict(job))."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


class ConfigRecord:
    """The effective configuration of a run, value by value, with the source of each value."""

    def __init__(self, config: Any, sources: Union[str, Mapping[str, str]]) -> None:
        """Start from a config dataclass (the composed job); sources: one label for every value, or one per key."""
        self.values = flat_config(config)
        self.sources = {k: sources if isinstance(sources, str) else sources[k] for k in self.values}

    def update(self, config: Any, source: Union[str, Mapping[str, str]]) -> list[str]:
        """Take the config after one stage: each value that changed is attributed to `source` (one label, or a
        label per key); returns the keys that changed. Keys the record does not hold (dropped) stay out."""
        changed = []
        for key, value in flat_config(config).items():
            if key in self.values and self.values[key] != value:
                label = source if isinstance(source, str) else source[key]
                was = f"{_yaml_scalar(self.values[key])}, {self.sources[key].split(';')[0]}"
                self.set(key, value, f"{label}; replaces {was}" if len(was) <= 80 else label)
                changed.append(key)
        return changed

    def set(self, key: str, value: Any, source: str) -> None:
        """One value resolved outside the config dataclass (e.g. attn.backend), with its source."""
        self.values[key] = _plain(value)
        self.sources[key] = source

    def drop(self, group: str) -> None:
        """Forget a group's values (a tool's own options, e.g. flexengine-plan's plan.*)."""
        for key in [k for k in self.values if k.startswith(group + ".")]:
            del self.values[key], self.sources[key]

    def kinds(self) -> dict[str, str]:
        """Dotted key -> the kind of its source (yours, config, default, first-contact, auto, given, model.path)."""
        return {k: s.split(":")[0] for k, s in self.sources.items()}

    def as_config(self) -> dict[str, Any]:
        """The values nested by group, like dataclasses.asdict(job): summary.json["config"]."""
        return nest(self.values)

    def to_yaml(self) -> str:
        """resolved_config.yaml: the values by group, each with its source as a comment. The first line makes it a
        global config: saved as <dir>/experiment/rerun.yaml, `flexengine-train --config-dir <dir> experiment=rerun`
        runs this configuration again."""
        lines = [
            "# @package _global_",
            "# The configuration the run trains with: Hydra's composition (.hydra/config.yaml) after first-contact",
            "# defaults, the attention rules, the hardware found, the planner's choices and train.epochs. The comment",
            "# on each value says where it came from: yours (the command line), config (that file), default (the",
            "# schema's), first-contact (model.path holds pretrained weights, no model group named), auto (resolved",
            "# by the run), model.path (model.arch: the architecture in model.path's config.json, which trains). To",
            "# run it again: copy it to <dir>/experiment/rerun.yaml and run",
            "#   flexengine-train --config-dir <dir> experiment=rerun",
        ]
        lines += _yaml_lines(self.as_config(), nest(self.sources), indent=0)
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> Path:
        """Write to_yaml() to `path` (atomically: a run killed mid-write leaves the previous file)."""
        write_text_atomic(Path(path), self.to_yaml())
        return Path(path)


def _yaml_scalar(value: Any) -> str:
    """One value in YAML flow style on one line."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=2**31, sort_keys=False)
    return text.removesuffix("\n...\n").removesuffix("\n")


def _yaml_lines(values: dict, sources: dict, indent: int) -> list[str]:
    pad = "  " * indent
    out = []
    for key, value in values.items():
        source = sources[key]
        if isinstance(source, dict):  # a group, or a nested config (model.lora): its values follow, indented
            out.append(f"{pad}{key}:")
            out += _yaml_lines(value, source, indent + 1)
        else:
            out.append(f"{pad}{key}: {_yaml_scalar(value)}  # {source}")
    return out
