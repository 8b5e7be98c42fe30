"""Checkpoints, single- and multi-rank: a standard HF directory plus the trainer state for an exact resume.

Layout of `<output_dir>/checkpoints/step_<N>/`:
  config.json, *.safetensors (or adapter_*), tokenizer files   the HF directory (`from_pretrained` loads it)
  trainer_state.pt                optimizer, scheduler, data position + data plan, RNG, counters (rank 0)
  trainer_state.rank<r>.pt        the same for rank r > 0 (its optimizer shard and RNG)
  merged/                         LoRA with train.merge_lora_on_save: base + adapters as a plain HF model
  manifest.json                   size and sha256 of every other file; written last

What makes it trustworthy:
- Every file is written into `.tmp_step_<N>_<host>_<pid>` and the directory is renamed into place only when
  all ranks have written their part, so a kill at any moment leaves the previous checkpoint as it was. Temp
  directories of dead processes on this host are removed at the next start.
- Free space is checked before writing (estimated from the tensors to save); a full disk is a one-line error.
- Resume verifies the manifest (sizes and checksums) and falls back to the newest step that verifies, moving
  the damaged one aside (`step_<N>.corrupt`), never deleting it.
- Trainer state is read with `torch.load(weights_only=True)`: a planted pickle payload cannot run code. The
  state holds only tensors and Python primitives (the numpy RNG state is stored as a tensor), so the allow-list
  is empty for torch's own optimizers; only torchao's optimizer-state tensor subclasses are added.
- Nothing here deletes another run's files: an existing step directory is never overwritten.

The file-level safety (manifests, temp dirs, free space, the output directory) lives in storage.py.
All ranks call `save_checkpoint`, `resolve_resume` and `load_checkpoint`; rank 0 writes the weights and decides,
the other ranks follow through collectives (a failure on any rank fails the call on every rank, no hang).
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from flexengine.errors import UserError, os_error_message
from flexengine.lora import adapter_to_model_keys, is_lora, merge_lora_state_dict
from flexengine.storage import (
    check_free_space,
    disk_full_message,
    list_checkpoints,
    move_aside,
    temp_dir_name,
    verify_manifest,
    write_manifest,
)

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
RANK_STATE = "trainer_state.rank{rank}.pt"  # ranks > 0: their optimizer shard and RNG, next to rank 0's state
SPACE_MARGIN = 1.05  # safetensors headers, tokenizer files, JSON: a few % on top of the tensor bytes


def verify_checkpoint(directory: Path) -> Optional[str]:
    """None if the step's manifest verifies (every file, its size and sha256) and lists the trainer state."""
    return verify_manifest(directory, required=(TRAINER_STATE,))


# -- sizes ---------------------------------------------------------------------------------------------------------

def _tensor_bytes(tensors: Iterable[Any]) -> int:
    # DTensor.numel() is the global size: the sum covers every rank's shard
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_tensors(obj: Any) -> Iterable[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _state_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _state_tensors(v)
    elif isinstance(obj, torch.Tensor):
        yield obj


def estimate_checkpoint_bytes(model: nn.Module, optimizer_state: dict, world_size: int = 1,
                              merged: bool = False) -> int:
    """Bytes one checkpoint takes: weights (trainable only for LoRA adapters) + optimizer states of all ranks
    (+ the merged model). Replicated (non-sharded) optimizer states are written once per rank."""
    params = list(model.parameters())
    weights = _tensor_bytes(p for p in params if p.requires_grad) if is_lora(model) else _tensor_bytes(params)
    states = list(_state_tensors(optimizer_state))
    opt = _tensor_bytes(states)
    if not any(hasattr(t, "to_local") for t in states):
        opt *= world_size
    base = _tensor_bytes(p for p in params if not p.requires_grad) if merged else 0
    return int((weights + opt + base) * SPACE_MARGIN)


# -- collectives (all no-ops in a single process) ----------------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_ok(ok: bool) -> bool:
    """True when every rank passes ok=True."""
    if not dist.is_initialized():
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _from_rank0(value: Any) -> Any:
    """Rank 0's value on every rank (a small Python object, between our own processes)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run_on_rank0(fn: Callable[[], Any]) -> Any:
    """fn() on rank 0, its result (or its UserError) on every rank."""
    result: Any = None
    error: Optional[str] = None
    if _rank() == 0:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    result, error = _from_rank0((result, error))
    if error is not None:
        raise UserError(error)
    return result


# -- state dicts -------------------------------------------------------------------------------------------------

def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 holds the model's parameters as DTensor shards."""
    return any(hasattr(p, "to_local") for p in model.parameters())


def gather_full_state_dict(model: nn.Module) -> dict:
    """The full (unsharded) state dict on CPU at rank 0 ({} elsewhere); every rank must call it."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()} if _rank() == 0 else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


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


def load_model_weights(model: nn.Module, directory: Path) -> None:
    """Load the safetensors weights of an HF directory (single file or shards) into a plain model in place."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors in {directory}: not a model checkpoint.")
    state: dict = {}
    for f in files:
        state.update(_read_safetensors(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not (model.config.tie_word_embeddings and "lm_head" in k)]
    if missing or unexpected:
        raise UserError(f"checkpoint {directory} does not match the model: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}; resume with the same model (and model.lora) settings.")


def _trusted_globals() -> list:
    """Types the trainer state may hold beyond tensors and Python primitives: torchao's optimizer-state tensor
    subclasses, when a torchao optimizer is in use (it imported torchao.optim; never imported just for this)."""
    if "torchao.optim" not in sys.modules:
        return []
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    return [OptimState4bit, OptimState8bit, OptimStateFp8]


def load_trainer_state(path: Path) -> dict:
    """A trainer_state*.pt file, loaded with weights_only=True (no code runs); a foreign file is refused."""
    if dist.is_initialized():
        importlib.import_module("torch.distributed.tensor")  # registers DTensor with the weights-only unpickler
    try:
        with torch.serialization.safe_globals(_trusted_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the checkpoint is incomplete.") from None
    except Exception as e:  # pickle.UnpicklingError for a disallowed global, RuntimeError for a damaged zip
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"refusing to load {path}: it is not a trainer state this flexengine wrote ({first}). It may have "
            "been tampered with; loading it could run code. Resume from a checkpoint you trust."
        ) from None
    if not isinstance(state, dict) or "train" not in state:
        raise UserError(f"{path} does not hold a flexengine trainer state.")
    return state


# -- save ----------------------------------------------------------------------------------------------------------

def _write_hf_dir(directory: Path, model: nn.Module, tokenizer, state: Optional[dict]) -> None:
    model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def _write_rank0_part(tmp: Path, model: nn.Module, tokenizer, trainer_state: dict, full: Optional[dict],
                      merge_lora) -> None:
    _write_hf_dir(tmp, model, tokenizer, full)
    torch.save(trainer_state, tmp / TRAINER_STATE)
    if merge_lora is not None:
        _write_hf_dir(tmp / "merged", model.get_base_model(), tokenizer, merge_lora_state_dict(full, merge_lora))


def _save_failure(path: Path, e: BaseException, needed: int) -> UserError:
    if isinstance(e, UserError):
        return e
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return UserError(disk_full_message(path, needed, shutil.disk_usage(path).free))
    if isinstance(e, OSError):
        return UserError(os_error_message(e, "saving a checkpoint"))
    return UserError(f"saving the checkpoint into {path} failed: {type(e).__name__}: {e}")


def save_checkpoint(root: Path, step: int, model: nn.Module, tokenizer, trainer_state: dict, *,
                    optimizer_state: Optional[dict] = None, merge_lora=None) -> Path:
    """Write root/step_<step>/ atomically on every rank's behalf; returns its path. Every rank calls this.

    Weights are gathered to rank 0 (FSDP), which writes the HF (or adapter) directory; ranks > 0 add their
    trainer state (optimizer shard, RNG) into the same temp dir. Refuses to overwrite an existing step.
    optimizer_state: the optimizer part of trainer_state (for the size estimate; defaults to trainer_state's).
    """
    rank, world_size = _rank(), _world_size()
    final = root / f"step_{step}"
    merged = merge_lora is not None
    full = gather_full_state_dict(model) if is_sharded(model) or merged else None  # a collective: all ranks
    trainer_state = {**trainer_state, "world_size": world_size}
    needed = estimate_checkpoint_bytes(model, optimizer_state if optimizer_state is not None
                                       else trainer_state.get("optimizer", {}), world_size, merged)

    def prepare() -> str:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(os_error_message(e, "creating the checkpoint directory")) from None
        if final.exists():
            raise UserError(f"{final} already exists; flexengine never overwrites a checkpoint. Move it away, or "
                            "resume this run with train.resume=auto.")
        check_free_space(root, needed)
        tmp = root / temp_dir_name(step)
        shutil.rmtree(tmp, ignore_errors=True)  # our own pid: a leftover of this very process
        tmp.mkdir()
        return str(tmp)

    tmp = Path(_run_on_rank0(prepare))
    error: Optional[BaseException] = None
    try:
        if rank == 0:
            _write_rank0_part(tmp, model, tokenizer, trainer_state, full, merge_lora)
        else:
            torch.save(trainer_state, tmp / RANK_STATE.format(rank=rank))
    except Exception as e:  # disk full, permissions, ...: the other ranks must hear of it, not hang
        error = e
    if not _all_ok(error is None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # free what the failed save took
        if error is not None:
            raise _save_failure(root, error, needed) from None
        raise UserError(f"saving {final} failed on another rank (see its message); {final} was not written.")

    def publish() -> str:
        try:
            write_manifest(tmp, step)
            os.replace(tmp, final)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _save_failure(root, e, needed) from None
        return str(final)

    final = Path(_run_on_rank0(publish))
    log.info("checkpoint saved: %s", final)
    return final


# -- resume ----------------------------------------------------------------------------------------------------

def _newest_verifying(root: Path) -> Optional[Path]:
    """The newest step that verifies; damaged newer ones are moved aside with a warning. Raises if all fail."""
    checkpoints = list_checkpoints(root)
    problems = []
    for _, path in checkpoints:
        problem = verify_checkpoint(path)
        if problem is None:
            if problems:
                log.warning("resume: falling back to %s, the newest checkpoint that verifies", path)
            return path
        moved = move_aside(path)
        problems.append(f"{path.name}: {problem}")
        log.warning("resume: %s fails verification (%s); moved aside to %s", path, problem, moved.name)
    if problems:
        raise UserError(f"train.resume=auto: no checkpoint under {root} verifies (" + "; ".join(problems)
                        + "). They were moved aside as step_<N>.corrupt; resume from a copy you trust, or start "
                          "a new run in a new train.output_dir.")
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
        problem = verify_checkpoint(path)
        if problem is not None:
            raise UserError(f"train.resume={spec}: the checkpoint fails verification: {problem}. Resume from "
                            "another step (train.resume=auto picks the newest one that verifies).")
        return str(path)

    chosen = _run_on_rank0(pick)
    return None if chosen is None else Path(chosen)


def load_checkpoint(path: Path, model: nn.Module) -> dict:
    """Load a verified checkpoint's weights (full, or LoRA adapters) on every rank; returns this rank's state."""
    rank, world_size = _rank(), _world_size()
    state = load_trainer_state(path / TRAINER_STATE)
    saved_world = state.get("world_size", 1)
    if saved_world != world_size:
        raise UserError(
            f"train.resume={path}: the checkpoint was written by {saved_world} rank(s) but this job has "
            f"{world_size}; resume with torchrun --nproc_per_node {saved_world} (optimizer states are sharded)."
        )
    if is_lora(model):
        _load_full_state_dict(model, adapter_to_model_keys(_read_safetensors(path / "adapter_model.safetensors")))
    elif not is_sharded(model):
        load_model_weights(model, path)
    else:
        weights: dict = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(_read_safetensors(f))
        _load_full_state_dict(model, weights)
    if rank > 0:
        state = load_trainer_state(path / RANK_STATE.format(rank=rank))
    return state


BEST_LINK = "best"  # checkpoints/best -> step_<N> of the lowest eval loss


def mark_best(root: Path, step_dir: Path) -> Path:
    """Point root/best at step_dir (a relative symlink, swapped atomically); returns the link."""
    link = root / BEST_LINK
    tmp = root / f".tmp_{BEST_LINK}_{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(step_dir.name, tmp, target_is_directory=True)
    os.replace(tmp, link)
    return link


def best_checkpoint(root: Path) -> Optional[Path]:
    """The checkpoint root/best points at, if it exists."""
    link = root / BEST_LINK
    return (root / os.readlink(link)) if link.is_symlink() and link.exists() else None


def prune_checkpoints(root: Path, keep_last: int, protect: tuple = ()) -> list[Path]:
    """Delete all but the newest keep_last step_<N> directories, never one in `protect` or the best; returns
    the deleted directories. keep_last <= 0 keeps everything."""
    if keep_last <= 0 or not root.is_dir():
        return []
    steps = sorted(list_checkpoints(root))  # oldest first
    keep = {p.resolve() for _, p in steps[-keep_last:]}
    keep |= {Path(p).resolve() for p in protect if p is not None}
    best = best_checkpoint(root)
    if best is not None:
        keep.add(best.resolve())
    deleted = []
    for _, path in steps:
        if path.resolve() not in keep:
            shutil.rmtree(path)
            deleted.append(path)
    if deleted:
        log.info("train.keep_last=%d: deleted %s", keep_last, ", ".join(p.name for p in deleted))
    return deleted
