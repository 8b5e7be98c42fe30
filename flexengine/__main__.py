"""`flexengine <command> [args]`: one console command for every tool (each also has its own script).

flexengine train [overrides]            python -m flexengine.train
flexengine plan [overrides]             python -m flexengine.plan
flexengine doctor [--steps N] [overrides]
flexengine stats [overrides]            python -m flexengine.stats
flexengine sweep <sweep_dir>            python -m flexengine.sweep
flexengine copy <group>/<name> <dir>    copy a shipped config to edit, then run it with --config-dir <dir>
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

from flexengine.cli.common import copy_config, fail
from flexengine.core.errors import UserError


def _copy_command(argv: list[str]) -> None:
    if len(argv) != 2:
        fail(
            UserError(
                "usage: flexengine copy <group>/<option> <dir>   e.g. flexengine copy "
                "experiment/deepseek7b_6k_a100 ./my_conf"
            )
        )
    try:
        target = copy_config(argv[0], Path(argv[1]))
    except UserError as e:
        fail(e)
    group, option = target.parent.name, target.stem
    print(
        f"copied to {target}\nedit it (rename it to make it your own), then run:\n"
        f"  flexengine-train --config-dir {Path(argv[1])} {group}={option}\n"
        f"  (check what it resolves to first: flexengine-train --config-dir {Path(argv[1])} {group}={option} "
        f"--cfg job)"
    )


def _command(name: str) -> Callable[[], Any]:
    # imported only when chosen: `flexengine plan` must not pay for the trainer's imports
    if name == "train":
        from flexengine.cli.train import main as run
    elif name == "plan":
        from flexengine.cli.plan import cli as run
    elif name == "doctor":
        from flexengine.cli.doctor import main as run
    elif name == "stats":
        from flexengine.cli.stats import main as run
    else:
        from flexengine.cli.sweep import main as run
    return run


COMMANDS = ("train", "plan", "doctor", "stats", "sweep", "copy")


def main(argv: Optional[list[str]] = None) -> None:
    """`flexengine <command> [args]`: one console command for every tool (each also has its own script)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.split("\n\n")[1] if argv and argv[0] in ("-h", "--help") else __doc__, file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    command, rest = argv[0], argv[1:]
    if command == "copy":
        _copy_command(rest)
        return
    sys.argv = [f"flexengine-{command}", *rest]  # Hydra and argparse read sys.argv
    _command(command)()


if __name__ == "__main__":
    main()
