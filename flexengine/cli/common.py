"""What every command-line entry point shares: the config schema, DictConfig -> JobConfig, one error printer,
the short config line, copying a shipped config. The `flexengine` command that dispatches to the tools is
flexengine/__main__.py (the tools import this module, so the dispatcher lives apart: imports point one way).

Importing this module registers nothing and imports neither Hydra nor torch: each entry point calls
`register_schema()` itself, and the heavy imports happen inside the commands that need them.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence

from flexengine.cli.config_errors import check_known_keys, composition_error
from flexengine.core.config import JobConfig, check_choice, conf_dir
from flexengine.core.config_record import AUTO_ATTENTION_RULES, ConfigRecord, flat_config
from flexengine.core.errors import UserError
from flexengine.core.storage import write_json_atomic

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

CONFIG_PATH = "pkg://flexengine.conf"  # Hydra finds the shipped configs through the package, wherever it lives
CONFIG_MODULE = "flexengine.conf"
SCHEMA_NAME = "job_schema"  # conf/config.yaml's first default
ERROR_FILE = "error.json"


def register_schema(node: type = JobConfig) -> None:
    """Make `node` (JobConfig or a subclass with a tool's own options) the schema conf/config.yaml composes on, and
    register `flexengine_output_root` (`${flexengine_output_root:${train.output_dir}}`: the value, or outputs when
    it is null), which hydra.run.dir uses (conf/config.yaml and the torchrun workers' override), and
    `flexengine_pid` (this process's id: launches started in the same second get a folder each)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name=SCHEMA_NAME, node=node)
    # "" too: run_dir treats an empty train.output_dir as unset, and "" here would put the run at /<date>/
    OmegaConf.register_new_resolver("flexengine_output_root", lambda value: value or "outputs", replace=True)
    OmegaConf.register_new_resolver("flexengine_pid", os.getpid, replace=True)


def to_job_config(cfg: Any, overrides: Optional[Sequence[str]] = None) -> JobConfig:
    """The composed DictConfig as a validated JobConfig (see to_job_record, which also says where each value came
    from)."""
    return to_job_record(cfg, overrides)[0]


def to_job_record(
    cfg: Any, overrides: Optional[Sequence[str]] = None, hydra_cfg: Any = None
) -> tuple[JobConfig, ConfigRecord]:
    """The composed DictConfig as a validated JobConfig (cross-field rules raise UserError), with fine-tuning
    defaults when model.path holds pretrained weights and no model group is named, and of two keys that exclude
    each other the later-set one winning (flexengine.cli.first_contact; overrides: the command line's, kept as
    given; None = Hydra's record of them inside a Hydra app); and the record of where each of its values came from
    (hydra_cfg: Hydra's own node, for the files composed; None = the running Hydra app's)."""
    from omegaconf import OmegaConf

    from flexengine.cli.config_sources import composed_sources, composition
    from flexengine.cli.first_contact import apply_pretrained_defaults, keep_rows_per_step, later_setting_wins
    from flexengine.surgery.attention.job_rules import resolve_attention_rules  # MODES, torch-free
    from flexengine.surgery.memory.kinds import check_granularity  # KINDS, torch-free

    typed, layers = composition(overrides, hydra_cfg)
    check_known_keys(cfg, typed)  # a + / ++ key the conversion below would drop unread
    overruled = later_setting_wins(cfg, layers)
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
    record = ConfigRecord(job, composed_sources(job, layers, typed))
    for key, source in overruled.items():
        record.set(key, None, source)
    resolve_attention_rules(job.attn, job.data, job.model)  # attn.mode against packing, window, RoPE
    record.update(job, AUTO_ATTENTION_RULES)
    job = keep_rows_per_step(job, typed, layers)
    record.update(job, "auto: keeps the config file's rows per optimizer step (train.micro_batch typed alone)")
    check_choice("precision.mode", job.precision.mode, group_options("precision"))
    check_granularity(job.memory.granularity)  # a kind of the recompute table, the only list of them
    return apply_pretrained_defaults(job, typed, record), record


def check_inputs_early(job: JobConfig) -> None:
    """model.path's files and the data's paths, checked before torch and transformers are imported (10-25 s on a
    loaded machine): a wrong path or a damaged model file stops within seconds, not after the imports. The same
    checks run again where the files are read."""
    from flexengine.data.sources import source_files
    from flexengine.data.split import eval_source
    from flexengine.surgery.model_files import check_model_dir

    if job.model.path is not None:
        check_model_dir(str(job.model.path), job.model.loads_weights)
    source_files(job.data)
    if job.data.eval_path:
        source_files(eval_source(job.data))


def group_options(group: str) -> tuple[str, ...]:
    """The shipped options of a config group (conf/<group>/*.yaml names), sorted. precision.mode is checked
    against them at composition: surgery/precision.SPECS holds torch dtypes, and composing a job must not import
    torch (tests/cli/test_common.py); tests/surgery/test_precision.py keeps these names == {"auto", *SPECS}, and
    precision_spec checks SPECS itself for a hand-built job."""
    return tuple(sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")))


def compose_config(overrides: Sequence[str], schema: type = JobConfig) -> Any:
    """Compose the shipped conf/ with the same overrides as `flexengine train`: the DictConfig an entry point gets."""
    return _compose(overrides, schema, lambda cfg, hydra_cfg: cfg)


def _compose(overrides: Sequence[str], schema: type, then: Callable[[Any, Any], Any]) -> Any:
    """then(the DictConfig an entry point gets, Hydra's own node), called inside the composition: there Hydra's
    loader can say which files it composed."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import open_dict

    register_schema(schema)
    with initialize_config_module(version_base="1.3", config_module=CONFIG_MODULE):
        try:
            cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        except HydraException as e:  # a misspelled key or group option, an override it cannot parse
            raise composition_error(e, schema, overrides) from None
        hydra_cfg = cfg.hydra
        with open_dict(cfg):
            del cfg["hydra"]
        return then(cfg, hydra_cfg)


def compose_job(overrides: Sequence[str], schema: type = JobConfig) -> JobConfig:
    """Compose the shipped conf/ with the same overrides as `flexengine train`, into a validated JobConfig."""
    return compose_job_record(overrides, schema)[0]


def compose_job_record(overrides: Sequence[str], schema: type = JobConfig) -> tuple[JobConfig, ConfigRecord]:
    """compose_job, and the record of where each value came from (flexengine.core.config_record)."""
    return _compose(overrides, schema, lambda cfg, hydra_cfg: to_job_record(cfg, overrides, hydra_cfg))


# Third-party lines that bury a run's first useful ones: torchao's optional CUDA kernels its wheel cannot load,
# torch's _pytree deprecation notes about torchao's enums, and HF's progress bars in job logs.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
QUIET_ENV = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")
VERBOSE_ENV = "FLEXENGINE_VERBOSE"  # =1 keeps every library's own output


def quiet_third_party() -> None:
    """Only flexengine's lines (and the libraries' errors) unless FLEXENGINE_VERBOSE=1: call it first in an entry
    point, before transformers or torchao are imported (HF reads its progress-bar switch at import)."""
    import logging

    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        return
    for name in QUIET_ENV:
        os.environ.setdefault(name, "1")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" in sys.modules:  # imported already: its switch was read; turn the bars off directly
        sys.modules["transformers"].utils.logging.disable_progress_bar()


FULL_ERROR_ENV = "HYDRA_FULL_ERROR"  # "1": Hydra raises its errors instead of printing them and exiting 1


def run_hydra_app(app: Callable[[], Any], schema: type = JobConfig) -> Any:
    """Run a `@hydra.main` app so that a composition error (an unknown key or group option, an override Hydra cannot
    parse) leaves like every UserError: one paragraph, exit 2. Hydra raises instead of reporting when
    HYDRA_FULL_ERROR=1, so it is set while the app runs; a user who set it gets Hydra's full report, and an error
    raised inside the task itself keeps its traceback."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        check_keys_before_hydra(sys.argv[1:], schema)
    except UserError as e:
        fail(e)
    users_choice = os.environ.get(FULL_ERROR_ENV)
    os.environ[FULL_ERROR_ENV] = "1"
    try:
        return app()
    except (HydraException, OmegaConfBaseException) as e:
        task = getattr(app, "__wrapped__", app).__code__
        in_task = any(frame.f_code is task for frame, _ in traceback.walk_tb(e.__traceback__))
        if users_choice == "1" or in_task:
            raise
        fail(composition_error(e, schema, sys.argv[1:]))
    finally:
        if users_choice is None:
            os.environ.pop(FULL_ERROR_ENV, None)
        else:
            os.environ[FULL_ERROR_ENV] = users_choice


def check_keys_before_hydra(argv: Sequence[str], schema: type = JobConfig) -> None:
    """Refuse (UserError) a key the schema lacks before Hydra launches a sweep (-m) or prints a config (--cfg),
    where an added `+key` slips past the task's own check: each job of the sweep fails alone (or none runs it),
    and --cfg prints the key as if it were valid. Composes the sweep's first combination, as the first job would;
    a command line this cannot mirror (--config-path, a glob sweep) is left to Hydra."""
    overrides = _first_combination(argv)
    if overrides is None:
        return
    from flexengine.cli.config_sources import command_line_keys

    check_known_keys(compose_config(overrides, schema), command_line_keys(overrides))


def _first_value(o: Override) -> str:
    """One parsed override as key=value: a sweep's first value (StopIteration: it has none), else as typed."""
    if o.is_sweep_override():
        return f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
    assert o.input_line is not None  # parse_overrides keeps the text of each override it parses
    return o.input_line


def _first_combination(argv: Sequence[str]) -> Optional[list[str]]:
    """The overrides of a sweep's first job, or of the config --cfg prints (with --config-dir as hydra.searchpath,
    which Hydra places the same way: after the shipped configs); None for a plain run (its task checks the keys)
    or a command line composed otherwise."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        args = get_args_parser().parse_args(list(argv))
    except SystemExit:  # argparse's own error: Hydra reports it
        return None
    if not (args.multirun or args.cfg) or args.config_path or args.config_name not in (None, "config"):
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
        first = [_first_value(o) for o in parsed]
    except (HydraException, StopIteration):  # an override Hydra cannot parse, a sweep it expands itself (glob)
        return None
    if args.config_dir:
        if any(o.get_key_element() == "hydra.searchpath" for o in parsed):
            return None
        first.append(f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]")
    return first


def fail(error: UserError) -> NoReturn:
    """The one way a command reports a user mistake: the message on stderr, exit status 2."""
    print(f"\nflexengine: error: {error}\n", file=sys.stderr, flush=True)
    sys.exit(2)


def write_job_error(job_dir: Path, exc: BaseException) -> Path:
    """Record a failed run as job_dir/error.json (type, message, traceback): the sweep summary's row for it."""
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / ERROR_FILE
    record = {
        "type": type(exc).__name__,
        "message": str(exc).strip(),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }
    write_json_atomic(path, record)  # through no link a shared output directory may hold
    return path


def free_memory() -> None:
    """Release a failed run's memory before the next job of a sweep (its CUDA cache above all)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


# The fields shown for each group in the start-up line, besides every field that differs from its default.
_SHORT_KEYS = {
    "model": ("name", "path", "init", "dtype"),
    "attn": ("mode", "backend"),
    "memory": ("policy",),
    "data": ("source", "path", "format", "seq_len", "packing"),
    "optim": ("name", "lr", "schedule", "warmup_steps"),
    "train": ("max_steps", "micro_batch", "grad_accum"),
    "hardware": ("name", "memory_gb"),
}


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        text = json.dumps(value, separators=(",", ":"), default=str)
        return text if len(text) <= 40 else text[:37] + "..."
    return str(value)


def format_job_short(job: JobConfig) -> str:
    """The resolved config in a few lines: each group's main fields and whatever differs from the defaults."""
    defaults = flat_config(type(job)())
    shown: dict[str, list[str]] = {}
    for key, value in flat_config(job).items():
        group, _, name = key.partition(".")
        if name in _SHORT_KEYS.get(group, ()) or (value != defaults[key] and value is not None):
            shown.setdefault(group, []).append(f"{name}={_short(value)}")
    return "\n".join(f"  {group}: " + " ".join(fields) for group, fields in shown.items())


def copy_config(name: str, dest: Path) -> Path:
    """Copy a shipped config (`experiment/deepseek7b_6k_a100`, `model/llama2_7b`, ...) to dest/<group>/<name>.yaml."""
    from importlib.resources import files

    group, _, option = name.removesuffix(".yaml").partition("/")
    source = files(CONFIG_MODULE) / group / f"{option}.yaml"
    if not option or not source.is_file():
        groups = sorted(p.name for p in files(CONFIG_MODULE).iterdir() if p.is_dir() and not p.name.startswith("_"))
        options = group_options(group) if group in groups else ()
        hint = f"options of {group}: {', '.join(options)}" if options else f"groups: {', '.join(groups)}"
        raise UserError(f"no shipped config {name!r}; give <group>/<option> ({hint}).")
    target = Path(dest) / group / f"{option}.yaml"
    if target.exists():
        raise UserError(f"{target} exists; remove it or copy to another directory.")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    return target
