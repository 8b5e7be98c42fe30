"""Checkpoints: a standard HF directory (safetensors + tokenizer) plus the trainer state for an exact resume.

Each save goes to a temporary directory that is renamed into place at the end, so a run killed mid-save never
leaves a half-written `step_<N>` behind and never touches the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(
    root: Path, step: int, model: torch.nn.Module, tokenizer, trainer_state: dict,
    model_state: Optional[dict] = None,
) -> Path:
    """Write root/step_<step>/ atomically; returns its path. model_state: a gathered full state dict (FSDP)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), state_dict=model_state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    torch.save(trainer_state, tmp / TRAINER_STATE)
    if final.exists():  # re-saving the same step (e.g. the final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    log.info("checkpoint saved: %s", final)
    return final


def find_latest_checkpoint(root: Path) -> Optional[Path]:
    """The complete step_<N> directory with the largest N under root, if any."""
    if not root.is_dir():
        return None
    steps = [
        (int(m.group(1)), p) for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / TRAINER_STATE).is_file()
    ]
    return max(steps)[1] if steps else None


def load_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load the safetensors weights of an HF directory (single file or shards) into `model` in place."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not (model.config.tie_word_embeddings and "lm_head" in k)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {directory} does not match the model: missing {missing}, "
                           f"unexpected {unexpected}")


def load_trainer_state(directory: Path) -> dict:
    """The optimizer/scheduler/data/RNG state saved next to the weights."""
    return torch.load(directory / TRAINER_STATE, map_location="cpu", weights_only=False)


def write_json_atomic(path: Path, data: dict) -> None:
    """json.dump through a temp file + rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


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
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())
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
