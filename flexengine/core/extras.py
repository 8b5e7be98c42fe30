"""Optional packages: each serves one feature and installs with one extra of flexengine (pyproject.toml's
[project.optional-dependencies]; `all` holds every one). A feature imports its package through `require`, inside
the feature, so that the engine runs without it and a missing one stops naming the setting that asked for it and the
command that installs it.

torchao is not here: precision=auto's choice on CUDA (the README's plans) is bf16_sr, torchao's optimizer, so a
plain install must plan and train as documented; it stays a dependency.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from flexengine.core.errors import UserError

EXTRAS = {  # package -> the extra that installs it
    "matplotlib": "plots",
    "datasets": "hf",
    "pyarrow": "parquet",
}


def install_command(package: str) -> str:
    """The pip command that installs `package` with its extra."""
    return f"pip install 'flexengine[{EXTRAS[package]}]'"


def require(module: str, needed_by: str, instead: str = "") -> ModuleType:
    """Import `module` (e.g. "pyarrow.parquet") of an optional package; when the package is absent, a UserError
    naming `needed_by` (the setting that asked for it), the install command and `instead` (what else to do)."""
    package = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] != package:
            raise  # the package is there but broken (one of its own imports failed): its error says more
        other = f", or {instead}" if instead else ""
        raise UserError(
            f"{needed_by} needs the `{package}` package, which is not installed: {install_command(package)}{other}."
        ) from None


def installed(package: str) -> bool:
    """Whether an optional package can be imported (imports nothing)."""
    return importlib.util.find_spec(package) is not None
