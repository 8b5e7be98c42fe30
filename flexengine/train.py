"""Entry point: `python -m flexengine.train [overrides]`. Hydra stops here: the library below sees a JobConfig.

Composes conf/ against the dataclass schemas of flexengine.config (a misspelled key or a wrong type fails at
composition), converts the DictConfig once into a typed JobConfig, and hands it to `run_training`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from flexengine.config import JobConfig
from flexengine.errors import UserError
from flexengine.sweep import free_memory, write_job_error

log = logging.getLogger("flexengine")

ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job_config(cfg: DictConfig) -> JobConfig:
    """The composed DictConfig as a validated JobConfig (cross-field rules raise UserError)."""
    try:
        job = OmegaConf.to_object(cfg)
    except UserError:
        raise
    except Exception as e:  # OmegaConf wraps errors raised inside __post_init__
        cause = e.__cause__ or e.__context__
        if isinstance(cause, UserError):
            raise cause from None
        raise UserError(f"invalid configuration: {e}") from None
    assert isinstance(job, JobConfig)
    return job


def run_dir(job: JobConfig) -> Path:
    """train.output_dir, or Hydra's run/sweep directory for this job."""
    if job.train.output_dir:
        return Path(job.train.output_dir)
    return Path(HydraConfig.get().runtime.output_dir)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    """Hydra task: compose -> JobConfig -> train -> summary.json."""
    try:
        job = to_job_config(cfg)  # config mistakes fail here, before the heavy imports below
        from flexengine.run import run_training

        return run_training(job, run_dir(job), OmegaConf.to_container(cfg, resolve=True))
    except Exception as e:  # UserError, OOM, ...: error.json makes a failed run a row of the sweep summary
        write_job_error(Path(HydraConfig.get().runtime.output_dir), e)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            if isinstance(e, UserError):
                print(f"\nflexengine: error: {e}\n", file=sys.stderr)
                sys.exit(2)
            raise
        # Hydra's basic launcher would abort the whole sweep on a raised exception: log it and go on.
        log.error("run failed, the sweep goes on (%s: %s)", type(e).__name__, e)
    free_memory()  # outside `except`: the traceback no longer holds the failed run's tensors
    return {"status": "failed"}


if __name__ == "__main__":
    main()
