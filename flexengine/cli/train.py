"""Entry point: `flexengine-train [overrides]` (= `python -m flexengine.train`). Hydra stops here.

Composes conf/ against the dataclass schemas of flexengine.core.config (a misspelled key or a wrong type fails at
composition), converts the DictConfig once into a typed JobConfig, prints it in short form, and hands it to
`run_training`. Hydra's own flags work as usual: `--cfg job` prints the composed config, `--config-dir DIR`
adds a directory of the user's own configs (see `flexengine copy`), `-m` runs a sweep.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from flexengine.cli.common import (
    CONFIG_PATH,
    check_inputs_early,
    fail,
    format_job_short,
    free_memory,
    quiet_third_party,
    register_schema,
    run_hydra_app,
    to_job_config,
    to_job_record,
    write_job_error,
)
from flexengine.core.config import JobConfig
from flexengine.core.errors import OutputDirTaken, UserError, os_error_message

__all__ = ["main", "run_dir", "to_job_config", "worker_overrides"]

log = logging.getLogger("flexengine")


def run_dir(job: JobConfig) -> Path:
    """train.output_dir, or Hydra's run/sweep directory for this job."""
    return Path(job.train.output_dir or HydraConfig.get().runtime.output_dir)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _main(cfg: DictConfig) -> dict:
    """Hydra task: compose -> JobConfig -> train -> summary.json."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    job_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        job, record = to_job_record(cfg)  # config mistakes fail here, before the heavy imports below
        check_inputs_early(job)  # so do missing paths and damaged model files
        if job.train.resume == "auto" and not job.train.output_dir and _pinned_run_dir(hydra_cfg):
            # the user's hydra.run.dir is the same directory at every launch: resume=auto has a run to look for
            job = dataclasses.replace(job, train=dataclasses.replace(job.train, output_dir=str(job_dir)))
            record.update(job, "auto: hydra.run.dir typed with train.resume=auto")
        # the short form after first-contact; the whole config as it runs, with sources: resolved_config.yaml
        log.info("config (Hydra's composition: %s/.hydra/config.yaml):\n%s", job_dir, format_job_short(job))
        from flexengine.run import run_training

        summary = run_training(job, run_dir(job), record)
    except KeyboardInterrupt as e:  # Ctrl-C outside the training loop (which stops cleanly by itself)
        write_job_error(job_dir, e)
        if multirun:
            _stop_sweep(Path(hydra_cfg.sweep.dir))
        log.error(
            "interrupted by SIGINT outside the training loop (while preparing the run, or a third signal "
            "during the final save): no new checkpoint was written; the previous ones are intact"
        )
        sys.exit(130)  # 128 + SIGINT, like a shell, without a traceback
    except Exception as e:  # UserError, OOM, ...: error.json makes a failed run a row of the sweep summary
        if not isinstance(e, OutputDirTaken):  # job_dir may be that other run's directory: leave it as it is
            write_job_error(job_dir, e)
        if not multirun:
            if isinstance(e, UserError):
                fail(e)
            raise
        # Hydra's basic launcher would abort the whole sweep on a raised exception: log it and go on.
        log.error("run failed, the sweep goes on (%s: %s)", type(e).__name__, e)
    else:
        if multirun and summary.get("status") == "interrupted":
            _stop_sweep(Path(hydra_cfg.sweep.dir))  # Ctrl-C stops the whole sweep, not just this job
        if summary["exit_code"]:  # stopped by SIGTERM/SIGINT after a clean save: 128 + signal, like a shell
            sys.exit(summary["exit_code"])  # (a scheduler tells preemption from completion)
        return summary
    free_memory()  # outside `except`: the traceback no longer holds the failed run's tensors
    return {"status": "failed"}


def _pinned_run_dir(hydra_cfg: HydraConf) -> bool:
    """Whether hydra.run.dir was given on the command line (not Hydra's fresh timestamped default)."""
    typed = [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.run.dir=") and o != WORKER_RUN_DIR]
    return hydra_cfg.mode == RunMode.RUN and bool(typed)  # a torchrun worker's own override is not the user's


def _stop_sweep(sweep_dir: Path) -> None:
    """An interrupted sweep ends here (Hydra's end-of-sweep callback will not run): summarise what ran."""
    from flexengine.cli.sweep import summarize_sweep

    log.warning("interrupted: the sweep stops after this job; summary of the jobs that ran:")
    summarize_sweep(sweep_dir)


# a torchrun rank > 0's Hydra run dir: the output root (quoted: a nested interpolation in an override)
WORKER_RUN_DIR = "hydra.run.dir='${flexengine_output_root:${train.output_dir}}'"


def worker_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides for a torchrun rank > 0 (its RANK is set before Hydra starts): Hydra's files are rank 0's.
    Each rank resolves conf/config.yaml's ${now:...} itself, so ranks starting in different seconds each made a
    <date>/<time>/ folder with .hydra/ and a train.log of one launch. A rank > 0 writes no .hydra/ and no log file
    (its lines still reach the console), and its Hydra run dir is the output root rank 0 creates anyway. A
    hydra.run.dir the user typed is kept: it is the same on every rank (train.resume=auto relies on it)."""
    if os.environ.get("RANK", "0") == "0":
        return []
    typed = [a.lstrip("+~") for a in argv]
    extra = ["hydra.output_subdir=null"]
    if not any(a.startswith(("hydra/job_logging=", "hydra.job_logging")) for a in typed):  # the user's logging stays
        # logging's dictConfig opens every handler listed, used or not: the file handler goes, not just its use
        extra += ["~hydra.job_logging.handlers.file", "hydra.job_logging.root.handlers=[console]"]
    if not any(a.startswith("hydra.run.dir=") for a in typed):
        extra.append(WORKER_RUN_DIR)
    return extra


# Hydra prints `--cfg job` before any of our code runs: the config as composed, not as it will run
CFG_JOB_NOTE = (
    "flexengine: --cfg job shows the config as composed (.hydra/config.yaml), before first-contact defaults "
    "(model.path with pretrained weights), the planner's precision / memory / micro-batch and the attention "
    "backend. The config as it will run, each value with its source: flexengine-plan <the same overrides> "
    "plan.format=resolved; a run writes it to resolved_config.yaml in its directory."
)


def main() -> None:
    """Console entry point: register the schema, then let Hydra parse sys.argv."""
    quiet_third_party()
    register_schema(JobConfig)
    sys.argv += worker_overrides(sys.argv[1:])
    try:
        run_hydra_app(_main)
    except OSError as e:  # Hydra's own files, before the task (which reports its own): the run dir, .hydra/, the log
        if isinstance(e, HydraException):  # MissingConfigException is an OSError: Hydra's report (HYDRA_FULL_ERROR)
            raise
        fail(
            UserError(
                os_error_message(e, "creating this launch's directory (Hydra's run dir, inside train.output_dir)")
            )
        )
    if {"--cfg", "-c"} & set(sys.argv[1:]) or any(a.startswith("--cfg=") for a in sys.argv[1:]):
        print(CFG_JOB_NOTE, file=sys.stderr)  # stdout stays Hydra's YAML


if __name__ == "__main__":
    main()
