"""Where each value of a composed config came from: the command line, a config file (named), or the schema's default.

Hydra keeps no per-value record, but it knows the rest: its defaults list is every config file it composed, in
order, each under its package, and `hydra.runtime.config_sources` is the search path that found them. The layers
below are those files' values in that order, then the keys the command line typed: the last layer that sets a key
owns it. The record starts here; flexengine.core.config_record follows the run's later stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import yaml

from flexengine.core.config import conf_dir
from flexengine.core.config_record import FROM_COMMAND_LINE, FROM_SCHEMA_DEFAULT, flat_config, from_config_file

COMMAND_LINE = "command line"  # the label of the last layer: the keys typed
# (label: a file, or COMMAND_LINE; {dotted key: value}) in composition order; None outside a Hydra composition
Layers = Optional[list[tuple[str, dict[str, Any]]]]


def command_line_keys(overrides: Iterable[str]) -> set[str]:
    """The dotted keys a list of Hydra overrides sets (`optim.lr=1e-4`, `+train.x=1`; group choices too)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def composition(overrides: Optional[Sequence[str]], hydra_cfg: Any = None) -> tuple[set[str], Layers]:
    """(the keys the command line typed, the layers of the composition). overrides: the command line's, None =
    Hydra's record of them inside a Hydra app; hydra_cfg: Hydra's own node, None = the running app's (then
    Hydra's own overrides count too: a hydra.searchpath adds files). Layers are None outside a Hydra composition."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    given = list(overrides or ())
    if hydra_cfg is None and HydraConfig.initialized():  # a Hydra app, or a test's compose
        hydra_cfg = HydraConfig.get()
        given = list(hydra_cfg.overrides.task) if overrides is None else given
        overrides = [*hydra_cfg.overrides.hydra, *hydra_cfg.overrides.task]
    typed = command_line_keys(given)
    if hydra_cfg is None or not GlobalHydra.instance().is_initialized():
        return typed, None  # a library call, or a config composed without its hydra node
    loader = GlobalHydra.instance().config_loader()
    defaults = loader.compute_defaults_list(hydra_cfg.job.config_name, list(overrides or ()), RunMode.RUN).defaults
    dirs = _search_dirs(hydra_cfg.runtime.config_sources)
    layers = [_file_layer(d.config_path, d.package or "", dirs) for d in defaults if d.config_path and not d.primary]
    choices = set(hydra_cfg.runtime.choices)  # a group typed (model=...) is its file's layer, not a key
    return typed, [*(layer for layer in layers if layer), (COMMAND_LINE, dict.fromkeys(typed - choices))]


def _search_dirs(config_sources: Any) -> list[tuple[Path, str]]:
    """(directory, how to name a file in it) of the config search path, first match first: a --config-dir's files by
    their path, the shipped ones as conf/<group>/<option>.yaml."""
    dirs = []
    for source in config_sources:
        if source.schema == "file" and source.path:
            dirs.append((Path(source.path), str(Path(source.path))))
        elif source.schema == "pkg" and source.path == "flexengine.conf":
            dirs.append((conf_dir(), "conf"))
    return dirs


def _file_layer(config_path: str, package: str, dirs: list[tuple[Path, str]]) -> Optional[tuple[str, dict]]:
    """(label, {dotted key: value}) of one composed file, its keys under the package Hydra put it in; None for a
    config found nowhere in dirs (the schema, Hydra's own, a plugin's search path: not attributed)."""
    found = next(((d / f"{config_path}.yaml", n) for d, n in dirs if (d / f"{config_path}.yaml").is_file()), None)
    if found is None:
        return None
    body = yaml.safe_load(found[0].read_text(encoding="utf-8")) or {}
    body.pop("defaults", None)
    return f"{found[1]}/{config_path}.yaml", _flat_values(body, f"{package}." if package else "")


def _flat_values(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat_values(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _touches(a: str, b: str) -> bool:
    """Whether setting dotted key a sets part of b or b itself (model.arch.hidden_size sets model.arch)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def composed_sources(job: Any, layers: Layers, typed: set[str]) -> dict[str, str]:
    """Dotted key -> source label for every value of the composed job: the last layer that sets it, else the
    schema's default. Without layers (outside Hydra) a key typed is the command line's, and a value that differs
    from the schema's default is labelled as coming from "the composed config files"."""
    defaults = flat_config(type(job)())
    out = {}
    for key, value in flat_config(job).items():
        owners = layers or [(COMMAND_LINE, dict.fromkeys(typed))]
        owner = next((label for label, keys in reversed(owners) if any(_touches(k, key) for k in keys)), None)
        if owner == COMMAND_LINE:
            out[key] = FROM_COMMAND_LINE
        elif owner is not None:
            out[key] = from_config_file(owner)
        elif layers is None and value != defaults.get(key):
            out[key] = from_config_file("the composed config files")
        else:
            out[key] = FROM_SCHEMA_DEFAULT
    return out


def last_setting(key: str, layers: Layers) -> Optional[tuple[int, str, Any]]:
    """(position in composition order, label, value) of the last layer that sets the dotted key: of two, the one at
    the higher position composed later and its value stands. None when none sets it (or outside Hydra)."""
    found = [(i, label, keys[key]) for i, (label, keys) in enumerate(layers or ()) if key in keys]
    return found[-1] if found else None


def file_setting(key: str, layers: Layers) -> Optional[tuple[int, str, Any]]:
    """last_setting among the config files only, before the command line."""
    return last_setting(key, [layer for layer in layers or () if layer[0] != COMMAND_LINE])
