"""Config mistakes caught at composition, told in the tool's own one-paragraph style (exit 2, like every UserError).

Two gaps in what Hydra checks by itself:
- a key added with `+key=value` or `++key=value` is not checked against the schema, and the conversion to a
  JobConfig drops it silently (`+train.batch_size=4` trained with micro_batch 2): `check_known_keys` refuses it;
- Hydra's own composition errors (a misspelled key, an unknown group option, an override it cannot parse) leave
  with exit 1 and several lines, one of which suggests the `+` that would hide the typo: `composition_error`
  turns them into one UserError (flexengine.cli.common.run_hydra_app catches them before Hydra prints anything).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Sequence

from flexengine.core.config_keys import unknown_key_message
from flexengine.core.errors import UserError

GRAMMAR_URL = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def _unknown_in(node: Any, prefix: str) -> Iterable[str]:
    """Dotted keys under `node` that its dataclass schema lacks; a dict-typed node (model.arch) is open-ended."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if not isinstance(node, (DictConfig, ListConfig)) or node._is_none() or node._is_missing():
        return  # a value, or a null / missing group
    if isinstance(node, ListConfig):
        for i, item in enumerate(node._iter_ex(resolve=False)):
            yield from _unknown_in(item, f"{prefix}{i}.")
        return
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # a plain dict field: keys of the user's choosing
    fields = {f.name for f in dataclasses.fields(schema)}
    for key, child in node.items_ex(resolve=False):
        if key not in fields:
            yield f"{prefix}{key!s}"
        else:
            yield from _unknown_in(child, f"{prefix}{key}.")


def keys_typed_under(key: str, command_line_keys: Iterable[str]) -> list[str]:
    """The command line's keys at or under `key`: the whole key typed finds the nearest real one
    (`trian.max_steps` -> train.max_steps), where the unknown part alone would not (`trian` -> data.train_on)."""
    return sorted(k for k in command_line_keys if k == key or k.startswith(key + "."))


def check_known_keys(cfg: Any, command_line_keys: set[str]) -> None:
    """Refuse keys of the composed config that its schema does not have (added with + or ++, or from a config
    file), naming each, where it came from, and the nearest real key."""
    from omegaconf import OmegaConf

    unknown = list(_unknown_in(cfg, ""))
    if not unknown:
        return

    origin = {}
    for key in unknown:  # `+trian.max_steps=1` adds the unknown key trian: the key typed is named
        typed = keys_typed_under(key, command_line_keys)
        origin.update(dict.fromkeys(typed, "the command line") if typed else {key: "a config file"})
    schema = OmegaConf.get_type(cfg)
    assert schema is not None  # keys are found unknown only below a dataclass schema, the root's first
    raise UserError(unknown_key_message(origin, schema))


def _lines(text: str) -> list[str]:
    """A Hydra/OmegaConf message's meaningful lines: no node-type dump, no config search path, no blank lines."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Config search path"):
            break
        if line and not line.startswith(("full_key:", "reference_type=", "object_type=")):
            out.append(line)
    return out


def composition_error(e: BaseException, schema: type, overrides: Sequence[str]) -> UserError:
    """A Hydra composition error as the tool's one paragraph: what was wrong, with the nearest key or the options
    (overrides: the command line's, to tell a key typed there from one in a config file)."""
    from hydra.errors import MissingConfigException, OverrideParseException

    from flexengine.cli.config_sources import command_line_keys

    cause = e.__cause__
    text = f"{e}\n{cause or ''}"
    missing = re.search(r"Key '[^']+' not in '[^']+'\s+full_key: (\S+)", text)
    if missing:
        key = missing.group(1)
        if key.startswith("hydra."):
            return UserError(f"{key} is not one of Hydra's settings (see `--cfg hydra` for them).")
        config_file = re.match(r"In '([^']+)'", str(e))
        origin = f"config {config_file.group(1)}" if config_file else "a config file"
        # Hydra names the first unknown part: `trian` for `trian.max_steps=3`
        typed = keys_typed_under(key, command_line_keys(overrides))
        if typed:
            key, origin = typed[0], "the command line"
        return UserError(unknown_key_message({key: origin}, schema))
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return UserError(
            f"{group}={option} is not a config of group {group}; choose one of {', '.join(e.options)} "
            f"(or your own {group}/{option}.yaml in a directory given with --config-dir; `flexengine copy` starts one)."
        )
    if isinstance(e, OverrideParseException):
        why = "; ".join(line for line in _lines(e.message) if not line.startswith(("See https", "Error parsing")))
        return UserError(
            f"cannot read the override {e.override!r}: {why}. Overrides are key=value (a list: key=[a,b]; a "
            f"value with spaces or brackets in quotes: 'key=\"a b\"'); Hydra's grammar: {GRAMMAR_URL}"
        )
    text = "; ".join(_lines(str(e))).rstrip(".").replace("Error merging override ", "cannot apply the override ")
    if cause is not None:
        text += ": " + "; ".join(_lines(str(cause))).rstrip(".")
    return UserError(text + ".")
