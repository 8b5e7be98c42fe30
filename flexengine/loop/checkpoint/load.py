"""Reading a checkpoint back: verify it, pick the step to resume (train.resume), load its weights and trainer state.

The layout and the guarantees are described in the package docstring. Trainer state is read with
`torch.load(weights_only=True)`; resume verifies the manifest and falls back to the newest step that verifies,
moving damaged ones aside. Every rank calls `resolve_resume` and `load_checkpoint_*`; rank 0 decides and reads the
shared files, the others follow (rank_sync.py).
"""

from __future__ import annotations

import importlib
import logging
import pickle
import re
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from flexengine.core.distributed import cpu_group, global_rank, global_world_size
from flexengine.core.errors import UserError
from flexengine.core.storage import (
    has_manifest,
    list_checkpoints,
    move_aside,
    older_format_message,
    read_manifest,
    verify_manifest,
)
from flexengine.loop.checkpoint import rank_sync
from flexengine.loop.checkpoint.rank_sync import on_every_rank, run_on_rank0
from flexengine.loop.nonfinite import nonfinite_names
from flexengine.surgery.lora import adapter_to_model_keys, is_lora
from flexengine.surgery.parallel import is_dtensor

log = logging.getLogger(__name__)


TRAINER_STATE = "trainer_state.pt"
RANK_STATE = "trainer_state.rank{rank}.pt"  # ranks > 0: their optimizer shard and RNG, next to rank 0's state
RANK_FILE = re.compile(r"^trainer_state\.rank\d+\.pt$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def verify_checkpoint(directory: Path) -> Optional[str]:
    """None if the step's manifest verifies (every file, its size and sha256) and lists the trainer state."""
    return verify_manifest(directory, required=(TRAINER_STATE,))


# -- state dicts -------------------------------------------------------------------------------------------------


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 holds the model's parameters as DTensor shards."""
    return any(is_dtensor(p) for p in model.parameters())


def _load_full_state_dict(model: nn.Module, state: dict) -> None:
    """Load full tensors (the same on every rank) into a plain or FSDP2-sharded model; only keys given."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise UserError(f"the checkpoint has weights the model does not: {result.unexpected_keys[:5]}.")


def _read_safetensors(path: Path) -> dict:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path} as safetensors ({e}); the file is damaged or not a checkpoint.") from None


def weight_files(directory: Path) -> list[Path]:
    """The top-level *.safetensors of a checkpoint: only those its manifest lists (a file dropped in later is
    never read), or all of them in a plain HF directory without a manifest."""
    if has_manifest(directory):
        listed = read_manifest(directory)["files"]
        return [directory / name for name in sorted(listed) if "/" not in name and name.endswith(".safetensors")]
    return sorted(directory.glob("*.safetensors"))


def _read_weights(directory: Path) -> dict:
    files = weight_files(directory)
    if not files:
        raise UserError(f"no *.safetensors in {directory}: not a model checkpoint.")
    return {name: tensor for f in files for name, tensor in _read_safetensors(f).items()}


def _check_loaded(model: nn.Module, directory: Path, result: Any) -> None:
    """load_state_dict's (missing, unexpected) keys as a UserError; tied weights are not missing."""
    from transformers import PretrainedConfig  # not at import: the model holds it loaded by now

    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    # a tied lm_head shares the input embedding's weight: its key is missing from the file by design
    config = model.config  # an HF model's: what this module loads
    head_tied = isinstance(config, PretrainedConfig) and config.tie_word_embeddings
    missing = [k for k in result.missing_keys if k not in tied and not (head_tied and "lm_head" in k)]
    if missing or result.unexpected_keys:
        raise UserError(
            f"checkpoint {directory} does not match the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}; resume with the same model (and model.lora) "
            "settings."
        )


def load_model_weights(model: nn.Module, directory: Path) -> None:
    """Load the safetensors weights of an HF directory (single file or shards) into a plain model in place."""
    _check_loaded(model, directory, model.load_state_dict(_read_weights(directory), strict=False))


def _trusted_globals() -> list:
    """Types the trainer state may hold beyond tensors and Python primitives: torchao's optimizer-state tensor
    subclasses, when a torchao optimizer is in use (it imported torchao.optim; never imported just for this)."""
    if "torchao.optim" not in sys.modules:
        return []
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    return [OptimState4bit, OptimState8bit, OptimStateFp8]


def first_line(e: BaseException) -> str:
    text = _ANSI.sub("", str(e)).strip()  # torch colours parts of its weights_only message
    return text.splitlines()[0] if text else type(e).__name__


def load_trainer_state(path: Path) -> dict:
    """A trainer_state*.pt file, loaded with weights_only=True (no code runs); a foreign file is refused."""
    if dist.is_initialized():
        importlib.import_module("torch.distributed.tensor")  # registers DTensor with the weights-only unpickler
    with torch.serialization.safe_globals(_trusted_globals()):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise UserError(f"{path} is missing: the checkpoint is incomplete.") from None
        except pickle.UnpicklingError as e:  # a global outside the allow-list, or not a torch.save file at all
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except Exception:  # not even a readable archive: the plain message below says so
                unsafe = []
            if unsafe:
                raise UserError(
                    f"refusing to load {path}: it holds {', '.join(sorted(unsafe)[:5])}, which no trainer state of "
                    "this flexengine holds. It may have been tampered with; loading it could run code. Resume from a "
                    "checkpoint you trust."
                ) from None
            raise UserError(
                f"cannot read {path} as a trainer state ({first_line(e)}); it is damaged or not a "
                "checkpoint of this flexengine. Resume from another checkpoint."
            ) from None
        except RuntimeError as e:  # a damaged zip archive (PytorchStreamReader failed ...)
            raise UserError(f"{path} is damaged ({first_line(e)}); resume from another checkpoint.") from None
    if not isinstance(state, dict) or "train" not in state:
        raise UserError(f"{path} does not hold a flexengine trainer state.")
    return state


# -- resume ----------------------------------------------------------------------------------------------------


def _newest_verifying(root: Path) -> Optional[Path]:
    """The newest step that verifies; damaged newer ones are moved aside with a warning. Raises if all fail, or
    on a step an older flexengine wrote (no manifest: not damaged, so not moved; but not resumable exactly)."""
    problems: list[str] = []
    for _, path in list_checkpoints(root):
        if not has_manifest(path):
            raise UserError(
                f"train.resume=auto: {older_format_message(path)}"
                + (f" (newer steps failed verification: {'; '.join(problems)})" if problems else "")
                + "."
            )
        problem = verify_checkpoint(path)
        if problem is None and (bad := nonfinite_weights(path)):
            moved = move_aside(path, ".nonfinite")  # never reloaded, and out of the way of the resumed run's saves
            problems.append(f"{path.name}: NaN/Inf in {', '.join(bad[:3])}")
            log.warning("resume: %s holds NaN/Inf weights (%s); moved aside to %s", path, bad[0], moved.name)
            continue
        if problem is None:
            if problems:
                log.warning("resume: falling back to %s, the newest checkpoint that verifies", path)
            return path
        moved = move_aside(path)
        problems.append(f"{path.name}: {problem}")
        log.warning("resume: %s fails verification (%s); moved aside to %s", path, problem, moved.name)
    if problems:
        raise UserError(
            f"train.resume=auto: no checkpoint under {root} verifies ("
            + "; ".join(problems)
            + "). They were moved aside (step_<N>.corrupt, or .nonfinite); resume from a copy you trust, or start "
            "a new run in a new train.output_dir."
        )
    return None


def resolve_resume(spec: str, root: Path, explicit_output_dir: bool = True) -> Optional[Path]:
    """train.resume -> the checkpoint to load (verified on rank 0, the same path on every rank), or None.

    auto: the newest step under root that verifies (damaged newer ones are moved aside); None if there is no
    checkpoint. A path: that step_<N> directory, which must verify (no silent fallback for an explicit choice).
    """

    def pick() -> Optional[str]:
        if spec == "auto":
            path = _newest_verifying(root)
            if path is None and not explicit_output_dir:
                raise UserError(
                    "train.resume=auto without train.output_dir: each run gets a new Hydra directory, so there is "
                    f"never a checkpoint to resume ({root.parent} is new). Set train.output_dir=DIR for the first "
                    "run and every resume (or resume a step directly: train.resume=.../checkpoints/step_<N>)."
                )
            if path is None:
                log.info("train.resume=auto: no checkpoint under %s, starting fresh", root)
            return None if path is None else str(path)
        path = Path(spec)
        if not (path / TRAINER_STATE).is_file():
            raise UserError(f"train.resume={spec!r} is not a checkpoint directory (no {TRAINER_STATE} in it).")
        if not has_manifest(path):
            raise UserError(f"train.resume={spec}: {older_format_message(path)}.")
        problem = verify_checkpoint(path)
        if problem is not None:
            raise UserError(
                f"train.resume={spec}: the checkpoint fails verification: {problem}. Resume from "
                "another step (train.resume=auto picks the newest one that verifies)."
            )
        bad = nonfinite_weights(path)
        if bad:
            raise UserError(
                f"train.resume={spec}: its weights hold NaN/Inf ({', '.join(bad[:3])}); training on would only "
                "produce NaN. Resume from an earlier step (train.resume=auto skips non-finite ones)."
            )
        return str(path)

    with cpu_group(rank_sync.COLLECTIVE_TIMEOUT_S) as group:  # rank 0 hashes the whole checkpoint meanwhile
        chosen = run_on_rank0(group, pick, f"train.resume={spec}")
    return None if chosen is None else Path(chosen)


def nonfinite_weights(path: Path) -> list[str]:
    """Names of the NaN/Inf tensors in a verified checkpoint's weight files; [] at once when the manifest records
    the save-time check (one saved without it, by a direct save_checkpoint call, is scanned one file at a time)."""
    if read_manifest(path).get("finite") is True:
        return []
    files = [path / "adapter_model.safetensors"] if (path / "adapter_model.safetensors").is_file() else []
    return [name for f in files or weight_files(path) for name in nonfinite_names(_read_safetensors(f).items())]


def load_checkpoint_state(path: Path) -> dict:
    """This rank's trainer state of a verified checkpoint (rank 0: trainer_state.pt, rank r: its own file), after
    checking the world size. Every rank calls it; a failure on one rank raises on all."""
    rank, world_size = global_rank(), global_world_size()

    def read() -> dict:
        saved_world = int(read_manifest(path)["world_size"])
        if saved_world != world_size:
            raise UserError(
                f"train.resume={path}: the checkpoint was written by {saved_world} rank(s) but this job has "
                f"{world_size}; resume with torchrun --nproc_per_node {saved_world} (optimizer states are sharded)."
            )
        return load_trainer_state(path / (TRAINER_STATE if rank == 0 else RANK_STATE.format(rank=rank)))

    with cpu_group(rank_sync.COLLECTIVE_TIMEOUT_S) as group:
        return on_every_rank(group, read, f"loading the trainer state of {path}")


def load_checkpoint_weights(path: Path, model: nn.Module) -> None:
    """Load a verified checkpoint's weights (full, or LoRA adapters) on every rank; only the files its manifest
    lists. Every rank calls it; the files are read before any collective, so a failure on one rank raises on all."""

    def read() -> dict:
        if is_lora(model):
            return adapter_to_model_keys(_read_safetensors(path / "adapter_model.safetensors"))
        return _read_weights(path)

    with cpu_group(rank_sync.COLLECTIVE_TIMEOUT_S) as group:
        weights = on_every_rank(group, read, f"reading the weights of {path}")
    if is_lora(model) or is_sharded(model):
        _load_full_state_dict(model, weights)
    else:
        _check_loaded(model, path, model.load_state_dict(weights, strict=False))
