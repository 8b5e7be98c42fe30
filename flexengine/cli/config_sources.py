"""Where each value of a composed config came from: the command line, a config file (named), or the schema's default.

Hydra composes the schema's defaults, then each chosen group option's YAML in the order of the defaults list, then
the command line; it keeps no per-value record. This module rebuilds one from what Hydra does keep: the overrides
typed, the group options chosen (`hydra.runtime.choices`) and the search path (`hydra.runtime.config_sources`),
reading each chosen option's file (with its `# @package`) and letting the last file that sets a key own it. The
record starts here; flexengine.core.config_record follows the run's later stages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import yaml

from flexengine.core.config import conf_dir
from flexengine.core.config_record import FROM_COMMAND_LINE, FROM_SCHEMA_DEFAULT, flat_config, from_config_file

_PACKAGE = re.compile(r"^#\s*@package\s+(\S+)")


def hydra_runtime(hydra_cfg: Any = None) -> Optional[Any]:
    """Hydra's `hydra.runtime` node: of hydra_cfg when given, else of the running Hydra app; None outside one."""
    if hydra_cfg is not None:
        return hydra_cfg.runtime
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime
    except ValueError:  # not inside a Hydra app (a library call, or compose without its hydra node)
        return None


def composed_sources(job: Any, typed: Iterable[str], runtime: Optional[Any]) -> dict[str, str]:
    """Dotted key -> source label for every value of the composed job. typed: the keys the command line set;
    runtime: Hydra's `hydra.runtime` (its choices and search path), or None: then a value no key typed explains
    and that differs from the schema's default is labelled as coming from "the composed config files"."""
    typed = set(typed)
    choices = dict(runtime.choices) if runtime is not None else {}
    values = flat_config(job)
    file_keys = _keys_set_by_files(choices, _search_dirs(runtime), values) if runtime is not None else {}
    defaults = flat_config(type(job)())
    out = {}
    for key, value in values.items():
        if any(t == key or t.startswith(key + ".") or key.startswith(t + ".") for t in typed - choices.keys()):
            out[key] = FROM_COMMAND_LINE
        elif key in file_keys:
            out[key] = from_config_file(file_keys[key])
        elif runtime is None and value != defaults.get(key):
            out[key] = from_config_file("the composed config files")
        else:
            out[key] = FROM_SCHEMA_DEFAULT
    return out


def _search_dirs(runtime: Any) -> list[tuple[Path, str]]:
    """(directory, how to name a file in it) of the config search path, first match first: a --config-dir's files by
    their path, the shipped ones as conf/<group>/<option>.yaml."""
    dirs = []
    for source in runtime.config_sources:
        if source.schema == "file" and source.path:
            dirs.append((Path(source.path), str(Path(source.path))))
        elif source.schema == "pkg" and source.path == "flexengine.conf":
            dirs.append((conf_dir(), "conf"))
    return dirs


def _keys_set_by_files(
    choices: Mapping[str, Optional[str]], dirs: list[tuple[Path, str]], leaves: Iterable[str]
) -> dict[str, str]:
    """The job's dotted key -> the last chosen option's file that sets it (or part of it: model.arch.hidden_size
    sets model.arch)."""
    leaves = list(leaves)
    owner: dict[str, str] = {}
    for label, values in _chosen_files(choices, dirs):
        for key in values:
            for leaf in leaves:
                if leaf == key or key.startswith(leaf + ".") or leaf.startswith(key + "."):
                    owner[leaf] = label
    return owner


def value_from_files(key: str, runtime: Optional[Any]) -> Optional[tuple[Any, str]]:
    """(value, file) of the last chosen config file that sets the dotted `key`, before the command line; None when
    no file sets it (or outside Hydra)."""
    found = last_file_setting(key, runtime)
    return None if found is None else found[1:]


def last_file_setting(key: str, runtime: Optional[Any]) -> Optional[tuple[int, Any, str]]:
    """(position in composition order, value, file) of the last chosen config file that sets the dotted `key`: of
    two files, the one at the higher position composed later and its value stands. None when no file sets it (or
    outside Hydra)."""
    if runtime is None:
        return None
    found = None
    for position, (label, values) in enumerate(_chosen_files(dict(runtime.choices), _search_dirs(runtime))):
        if key in values:
            found = position, values[key], label
    return found


def _chosen_files(choices: Mapping[str, Optional[str]], dirs: list[tuple[Path, str]]) -> list[tuple[str, dict]]:
    """(file label, {dotted key: value}) of each chosen group option's file, in composition order. Hydra's choices
    list the defaults tree last-composed first (experiment before model before optim), hence reversed."""
    out = []
    for group, option in reversed(list(choices.items())):
        if option is None or group.startswith("hydra"):
            continue
        path, name = next(
            ((d / group / f"{option}.yaml", n) for d, n in dirs if (d / group / f"{option}.yaml").is_file()), (None, "")
        )
        if path is not None:  # else an option Hydra found elsewhere (a plugin's search path): not attributed
            out.append((f"{name}/{group}/{option}.yaml", _file_values(path, group)))
    return out


def _file_values(path: Path, group: str) -> dict[str, Any]:
    """The dotted keys one option file sets and their values, under its package (`# @package _global_`, else the
    group's)."""
    text = path.read_text(encoding="utf-8")
    package = group.replace("/", ".")
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        match = _PACKAGE.match(line)
        if match:
            package = "" if match.group(1) == "_global_" else match.group(1).replace("_group_", package)
    body = yaml.safe_load(text) or {}
    body.pop("defaults", None)
    return {f"{package}.{key}" if package else key: value for key, value in _flat_values(body).items()}


def _flat_values(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat_values(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
