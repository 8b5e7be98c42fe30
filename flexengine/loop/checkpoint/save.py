"""Writing a checkpoint: every rank its part into a temp directory, rank 0 the HF weights, the manifest last, then
one rename (the layout and guarantees: the package docstring); marking the best step and pruning old ones."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from flexengine.core.config import LoraConfig
from flexengine.core.distributed import cpu_group, global_rank, global_world_size
from flexengine.core.errors import UserError, os_error_message
from flexengine.core.storage import (
    check_free_space,
    disk_full_message,
    fsync_dir,
    list_checkpoints,
    seal_files,
    size_text,
    temp_dir_name,
    tree_bytes,
    write_manifest,
)
from flexengine.loop.checkpoint import rank_sync
from flexengine.loop.checkpoint.load import RANK_FILE, RANK_STATE, TRAINER_STATE, first_line, is_sharded, weight_files
from flexengine.loop.checkpoint.rank_sync import on_every_rank, run_on_rank0
from flexengine.surgery.lora import hf_key, is_lora, merge_lora_state_dict
from flexengine.surgery.model_files import DTYPE_BYTES
from flexengine.surgery.parallel import is_dtensor, local_shard

log = logging.getLogger(__name__)

SPACE_MARGIN = 1.05  # safetensors headers, tokenizer files, JSON: a few % on top of the tensor bytes


def step_dir(root: Path, step: int) -> Path:
    """Where step <step> of a run lives: root/step_<step>."""
    return root / f"step_{step}"


# -- sizes ---------------------------------------------------------------------------------------------------------


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor takes on disk: a DTensor's global size (every rank's shard), a tensor subclass's inner
    tensors (torchao's 8-bit state reports fp32 numel but stores int8 codes + scales: 4x less)."""
    if is_dtensor(t):  # numel() is global; its local shard says how many bytes per element
        local = local_shard(t)
        if local.numel() == 0:
            return t.numel() * local.element_size()
        return stored_bytes(local) * t.numel() // local.numel()
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _tensor_bytes(tensors: Iterable[Any]) -> int:
    return sum(stored_bytes(t) for t in tensors if isinstance(t, torch.Tensor))


def _state_tensors(obj: Any) -> Iterable[Any]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _state_tensors(v)


def estimate_checkpoint_bytes(
    model: nn.Module, optimizer_state: dict, world_size: int = 1, merged: bool = False
) -> int:
    """Bytes one checkpoint takes: weights (trainable only for LoRA adapters) + optimizer states of all ranks
    (+ the merged model). Replicated (non-sharded) optimizer states are written once per rank."""
    params = list(model.parameters())
    weights = _tensor_bytes(p for p in params if p.requires_grad) if is_lora(model) else _tensor_bytes(params)
    states = list(_state_tensors(optimizer_state))
    opt = _tensor_bytes(states)
    if not any(is_dtensor(t) for t in states):
        opt *= world_size
    # the merged export is written in the adapters' dtype (lora.merge_lora_state_dict), whatever the frozen base's
    master_size = next((p.element_size() for p in params if p.requires_grad), 4)
    base = sum(p.numel() for p in params if not p.requires_grad) * master_size if merged else 0
    return int((weights + opt + base) * SPACE_MARGIN)


# -- save ----------------------------------------------------------------------------------------------------------


def gather_full_state_dict(model: nn.Module) -> dict:
    """The full (unsharded) state dict on CPU at rank 0 ({} elsewhere); every rank must call it."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()} if global_rank() == 0 else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@runtime_checkable
class _SavesPretrained(Protocol):
    """A transformers or peft model: writes itself as an HF directory."""

    def save_pretrained(self, save_directory: str, *, state_dict: Optional[dict], safe_serialization: bool) -> Any: ...


@runtime_checkable
class _WrapsBaseModel(Protocol):
    """A peft model: the plain HF model its adapters sit in."""

    def get_base_model(self) -> nn.Module: ...


def _write_hf_dir(directory: Path, model: nn.Module, tokenizer: Any, state: Optional[dict]) -> None:
    if not isinstance(model, _SavesPretrained):
        raise TypeError(f"a checkpoint is written by a transformers or peft model, got {type(model).__name__}")
    model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
    _enable_kv_cache(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def _enable_kv_cache(directory: Path) -> None:
    """The saved config.json and generation_config.json (which `generate` reads) with use_cache true: training runs
    with the KV cache off (with it on, HF skips its packed-sequence handling), but an export is loaded to generate,
    where the cache is what makes it fast. The live model's config stays as training needs it. (A LoRA checkpoint
    has neither file: adapters only.)"""
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        if config.get("use_cache") is False:
            config["use_cache"] = True
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # HF's own layout


def exact_base(directory: Optional[Path], state: dict) -> Optional[Callable[[str], Optional[torch.Tensor]]]:
    """For the LoRA merge: hf key -> the frozen tensor as `directory` (model.path) stores it, where it stores it
    wider than `state` holds it (an fp32 checkpoint whose base a bf16 mode keeps in bf16), else None. Tensors are
    read one at a time, when the merge asks."""
    if directory is None:
        return None
    from safetensors import safe_open

    held = {hf_key(k): v.element_size() for k, v in state.items() if ".lora_" not in k and v.is_floating_point()}
    where = {}
    for f in weight_files(directory):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if key in held and DTYPE_BYTES.get(handle.get_slice(key).get_dtype(), 0) > held[key]:
                    where[key] = f

    def read(key: str) -> Optional[torch.Tensor]:
        if key not in where:
            return None
        with safe_open(str(where[key]), framework="pt") as handle:
            return handle.get_tensor(key)

    return read


def _write_rank0_part(
    tmp: Path,
    model: nn.Module,
    tokenizer: Any,
    trainer_state: dict,
    full: Optional[dict],
    merge_lora: Optional[LoraConfig],
    *,
    base_dir: Optional[Path] = None,
) -> list[str]:
    """The HF directory, rank 0's trainer state (and merged/); returns the files written, relative to tmp."""
    _write_hf_dir(tmp, model, tokenizer, full)
    torch.save(trainer_state, tmp / TRAINER_STATE)
    if merge_lora is not None:
        # merge_lora is set for a peft model only, and rank 0 then holds the gathered state (_weights_to_write)
        assert isinstance(model, _WrapsBaseModel) and full is not None
        merged = merge_lora_state_dict(full, merge_lora, exact_base(base_dir, full))
        _write_hf_dir(tmp / "merged", model.get_base_model(), tokenizer, merged)
    # the other ranks write their trainer_state.rank<r>.pt into the same directory meanwhile: theirs to seal
    return [str(p.relative_to(tmp)) for p in sorted(tmp.rglob("*")) if p.is_file() and not RANK_FILE.match(p.name)]


_DISK_FULL_TEXT = ("os error 28", "No space left on device", "os error 122", "Disk quota exceeded")
# a write past `ulimit -f`: write(2)'s EFBIG (Python ignores SIGXFSZ), or the short write torch.save's zip writer
# reports as `[enforce fail at inline_container.cc:...] unexpected pos ...`
_SIZE_LIMIT_TEXT = ("os error 27", "File too large", "unexpected pos")
_NEARLY_FULL = 64 << 20  # bytes: after a failed write, less than this free is a full disk whatever was estimated


def _save_failure(root: Path, tmp: Path, e: BaseException, needed: int) -> UserError:
    """A failed write as one paragraph. A full disk says `disk full at ...` even when the writer reports it
    without an errno: torch.save's zip writer raises RuntimeError('[enforce fail at inline_container.cc:...]
    unexpected pos ...'), safetensors SafetensorError('... I/O error: No space left on device (os error 28)').
    Measured before the partial save is removed, so the space it took still counts as used."""
    if isinstance(e, UserError):
        return e
    limit = _file_size_limit(e)
    if limit is not None:
        return UserError(
            f"saving the checkpoint into {root} hit the file-size limit: this process may write files of at most "
            f"{size_text(limit)} (ulimit -f), and this checkpoint needs {size_text(needed)}. Raise the limit "
            "(ulimit -f unlimited, or the job scheduler's file-size limit) and resume with train.resume=auto; the "
            "previous checkpoint (if any) is intact."
        )
    written = tree_bytes(tmp) if tmp.is_dir() else 0
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    full = (
        (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
        or any(text in str(e) for text in _DISK_FULL_TEXT)
        or (free is not None and free < max(needed - written, _NEARLY_FULL))
    )
    if full and free is not None:  # the free space once the partial save is gone: what the user will see
        return UserError(disk_full_message(root, needed, free + written))
    if isinstance(e, OSError):
        return UserError(os_error_message(e, "saving a checkpoint"))
    return UserError(f"saving the checkpoint into {root} failed: {type(e).__name__}: {first_line(e)}")


def _file_size_limit(e: BaseException) -> Optional[int]:
    """The process's file-size limit in bytes when `e` is a write that ran into it, else None."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft == resource.RLIM_INFINITY:
        return None
    hit = (isinstance(e, OSError) and e.errno == errno.EFBIG) or any(text in str(e) for text in _SIZE_LIMIT_TEXT)
    return soft if hit else None


def _weights_to_write(model: nn.Module, weights: Optional[dict], merged: bool, rank: int) -> tuple[Optional[dict], int]:
    """The state dict rank 0 writes (None: the model's own) and the bytes on disk `weights` add over the model's
    own tensors they stand in for. Every rank must call it (gathering a sharded model is a collective)."""
    full = gather_full_state_dict(model) if is_sharded(model) or merged else None  # a collective: all ranks
    replaced = 0  # bytes of the model's own tensors that `weights` stand in for
    if weights and rank == 0:
        own = full if full is not None else model.state_dict()
        replaced = _tensor_bytes(own[name] for name in weights)
        full = {**own, **weights}
    return full, int((_tensor_bytes((weights or {}).values()) - replaced) * SPACE_MARGIN)


def _prepare_temp_dir(root: Path, final: Path, step: int, needed: int) -> str:
    """Rank 0: refuse an existing step, check the free space, make an empty temp dir; returns its path."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(os_error_message(e, "creating the checkpoint directory")) from None
    if final.exists():
        raise UserError(
            f"{final} already exists; flexengine never overwrites a checkpoint. Move it away, or "
            "resume this run with train.resume=auto."
        )
    check_free_space(root, needed)
    tmp = root / temp_dir_name(step)
    if tmp.is_symlink():  # planted at this process's name: the save goes into a directory made here, not there
        tmp.unlink()
    shutil.rmtree(tmp, ignore_errors=True)  # our own pid: a leftover of this very process
    try:
        tmp.mkdir()
    except OSError as e:
        raise UserError(os_error_message(e, "creating the checkpoint's temporary directory")) from None
    return str(tmp)


def _write_rank_part(
    tmp: Path,
    root: Path,
    needed: int,
    *,
    rank: int,
    model: nn.Module,
    tokenizer: Any,
    trainer_state: dict,
    full: Optional[dict],
    merge_lora: Optional[LoraConfig],
    base_dir: Optional[Path],
) -> dict:
    """This rank's files in tmp (rank 0: the HF directory too), fsynced and hashed: {name: manifest entry}."""
    try:
        if rank == 0:
            names = _write_rank0_part(tmp, model, tokenizer, trainer_state, full, merge_lora, base_dir=base_dir)
        else:
            names = [RANK_STATE.format(rank=rank)]
            torch.save(trainer_state, tmp / names[0])
        return seal_files(tmp, names)
    except Exception as e:  # disk full, permissions, ...: every rank hears of it (on_every_rank)
        raise _save_failure(root, tmp, e, needed) from e


def _write_on_every_rank(group: Any, tmp: Path, final: Path, write: Callable[[], dict]) -> dict:
    """Every rank writes and seals its part of tmp; returns all ranks' {name: manifest entry}. A failure on any
    rank fails every rank, and rank 0 removes tmp."""
    try:
        parts = on_every_rank(group, write, f"writing {final}", share=True)
    except BaseException:
        if global_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # free what the failed save took (every rank is done)
        raise
    return {name: entry for part in parts for name, entry in part.items()}


def _publish(root: Path, step: int, tmp: Path, sealed: dict, needed: int, **facts: object) -> str:
    """Rank 0: the manifest (with `facts`) written last, then the atomic rename into place; returns the final path."""
    final = step_dir(root, step)
    try:
        write_manifest(tmp, step, sealed, **facts)
        os.replace(tmp, final)
        fsync_dir(root)  # the rename itself survives a power cut
    except Exception as e:
        failure = _save_failure(root, tmp, e, needed)
        shutil.rmtree(tmp, ignore_errors=True)
        raise failure from e
    return str(final)


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    tokenizer: Any,
    trainer_state: dict,
    *,
    merge_lora: Optional[LoraConfig] = None,
    weights: Optional[dict] = None,
    finite_checked: bool = False,
    base_dir: Optional[Path] = None,
) -> Path:
    """Write root/step_<step>/ atomically on every rank's behalf; returns its path. Every rank calls this.

    Weights are gathered to rank 0 (FSDP), which writes the HF (or adapter) directory; ranks > 0 add their
    trainer state (optimizer shard, RNG) into the same temp dir. Each rank fsyncs and hashes what it wrote;
    rank 0 writes the manifest and renames the directory into place. Refuses to overwrite an existing step.
    merge_lora: the LoraConfig, to also write merged/ (base + adapters as a plain HF model).
    weights: {state-dict name: tensor} written in place of the model's own (a host optimizer's fp32 masters: the
    bf16 device copy has rounded their small updates away). Resume loads them back into the device dtype (the
    same rounding the optimizer's upload makes) and the masters from the optimizer state: still exact.
    finite_checked: the caller found no NaN/Inf in what is saved (Trainer.save): the manifest says so, and
    train.resume=auto need not scan the weights again.
    base_dir: with merge_lora, the directory the frozen base was loaded from (model.path): merged/ takes the base
    as stored there, not the copy a bf16 mode rounded (lora.merge_lora_state_dict).
    """
    rank, world_size = global_rank(), global_world_size()
    final = step_dir(root, step)
    merged = merge_lora is not None
    full, extra = _weights_to_write(model, weights, merged, rank)
    trainer_state = {**trainer_state, "world_size": world_size}
    needed = estimate_checkpoint_bytes(model, trainer_state.get("optimizer", {}), world_size, merged) + extra
    facts = {"world_size": world_size, **({"finite": True} if finite_checked else {})}
    with cpu_group(rank_sync.COLLECTIVE_TIMEOUT_S) as group:
        tmp = Path(run_on_rank0(group, partial(_prepare_temp_dir, root, final, step, needed), f"preparing {final}"))
        write = partial(
            _write_rank_part,
            tmp,
            root,
            needed,
            rank=rank,
            model=model,
            tokenizer=tokenizer,
            trainer_state=trainer_state,
            full=full,
            merge_lora=merge_lora,
            base_dir=base_dir,
        )
        sealed = _write_on_every_rank(group, tmp, final, write)
        publish = partial(_publish, root, step, tmp, sealed, needed, **facts)
        final = Path(run_on_rank0(group, publish, f"publishing {final}"))
    log.info("checkpoint saved: %s", final)
    return final


BEST_LINK = "best"  # checkpoints/best -> step_<N> of the lowest eval loss


def mark_best(root: Path, step_dir: Path) -> Path:
    """Point root/best at step_dir (a relative symlink, swapped atomically); returns the link."""
    link = root / BEST_LINK
    tmp = root / f".tmp_{BEST_LINK}_{os.getpid()}"
    tmp.unlink(missing_ok=True)
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
    keep |= {Path(p).resolve() for p in (*protect, best_checkpoint(root)) if p is not None}
    deleted = []
    for _, path in steps:
        if path.is_symlink():  # someone linked it in: not this run's to delete (rmtree refuses links anyway)
            log.warning(
                "train.keep_last=%d: %s is a symbolic link, not a checkpoint this run wrote; left as it is",
                keep_last,
                path,
            )
            continue
        if path.resolve() not in keep:
            shutil.rmtree(path)
            deleted.append(path)
    if deleted:
        log.info("train.keep_last=%d: deleted %s", keep_last, ", ".join(p.name for p in deleted))
    return deleted
