"""One real training step of the engine's model under PyTorch's own memory tracker, and the planner's terms for
the same step: an independent second opinion on flexengine.planning (bench/planner_vs_memtracker.py; at 2-4 layers,
tests/planning/test_planner_vs_memtracker.py).

The step is the trainer's (loop/trainer.py): forward under the precision's compute context with the chunked loss,
backward, optimizer step, with the gradients already allocated (the middle of an accumulation window: gradients of
the parameters' shapes and dtypes, and the optimizer states one step made). The model is stock HF LLaMA blocks with
the engine's surgery, built as run.py builds it: load_model in the precision's parameter dtype, apply_precision, the
flexengine attention patch (flex backend, as on CUDA), apply_memory_policy; the precision's optimizer
(optim.build_optimizer, CUDA's choice). `torch.distributed._tools.mem_tracker.MemTracker` watches it over
`FakeTensorMode`: fake tensors carry shapes and dtypes but no bytes, so a 7B-wide model at 8K rows costs nothing.
Fake CPU tensors stand for CUDA ones (a CPU-only torch refuses fake CUDA): no allocator rounding, the tracker counts
tensor bytes as the planner does; CPU autocast makes the same casts as CUDA's for this model's ops. The other
stand-ins: bench/memtracker_standins.py.

Blocks run eagerly: a dispatch mode makes dynamo skip compiled frames. So op-level SAC here keeps its cache
outside autograd's saved tensors, where offload's hooks never see it (`ops+offload` offloads only the checkpoint
inputs); on a GPU SAC blocks are compiled (with flex they must be), and the compiled block's saved tensors are
offloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from memtracker_cases import Case, planner_step
from memtracker_standins import eager_step, fake_safe_offload, functional_loss, host_on_meta, install_flex_stand_in
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import flexengine.surgery.loss as engine_loss
from flexengine.loop.optim import build_optimizer
from flexengine.surgery.applied import applied
from flexengine.surgery.attention.patch import apply_attention, mask_kwargs
from flexengine.surgery.attention.spec import resolve_attention_spec
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
from flexengine.surgery.model import build_hf_config, load_model
from flexengine.surgery.precision import apply_precision, precision_spec


@dataclass(frozen=True)
class Origin:
    """Where a storage was made: phase (forward | backward | recompute | optimizer | before), the innermost module,
    the op, and whether it is autocast's copy of a parameter."""

    phase: str
    module: str
    op: str
    weight_copy: bool = False


class PeakTracker(MemTracker):
    """MemTracker that also keeps, at the device's peak, every live storage's reference type and Origin, and
    each phase's own peak. Device: the fake CPU tensors; meta tensors are host memory (HostOnMeta)."""

    def __init__(self, params: set) -> None:
        super().__init__()
        self._params = params  # ids of the model's parameters: a _to_copy of one is autocast's weight copy
        self._op: Optional[Origin] = None
        self._origins: dict[int, Origin] = {}
        self._live: dict[int, Any] = {}  # id(winfo) -> winfo, device storages only
        self._best, self._pending = 0, False
        self.at_peak: list[tuple[str, int, Origin]] = []
        self.phase_peaks: dict[str, int] = defaultdict(int)

    def _phase(self) -> str:
        if self._in_opt:
            return "optimizer"
        if self._mod_tracker.is_bw:
            return "recompute" if self._in_ac else "backward"
        return "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        parents = self._mod_tracker.parents
        module = max(parents, key=lambda name: (name.count("."), len(name))) if parents else "Global"
        copy = func is torch.ops.aten._to_copy.default and id(args[0]) in self._params
        self._op = Origin(self._phase(), module, str(func), copy)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._op = None

    def _device_total(self) -> int:
        return self._curr_mem_snap.get(torch.device("cpu"), {}).get("Total", 0)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        on_device = winfo.device.type == "cpu"
        if on_device and u_type.name == "DEL":
            if self._pending and self._device_total() >= self._best:
                self._capture()
            self._live.pop(id(winfo), None)
        if on_device and u_type.name == "ADD":
            self._live[id(winfo)] = winfo
            self._origins[id(winfo)] = self._op or Origin("before", "", str(winfo.reftype.value))
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def _update_peak_stats(self, peak_state) -> None:
        # MemTracker's global peak per device, without its per-module peaks (unused here: they cost a pass over
        # every module per op, a quarter of the run at 8 layers)
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap["Total"]:
                self._peak_mem[device], self._peak_mem_snap[device] = snap["Total"], dict(snap)
        total = self._device_total()
        phase = self._phase()
        self.phase_peaks[phase] = max(self.phase_peaks[phase], total)
        # the peak compared with the plan is forward's and backward's: an optimizer step that runs eagerly here
        # (torchao's) makes temporaries its compiled GPU step does not; its own peak is kept in phase_peaks
        if total > self._best and phase != "optimizer":
            self._best, self._pending = total, True

    def live(self) -> list[tuple[str, int, Origin]]:
        """Every live device storage now: (MemTracker reference type, bytes, Origin)."""
        return [(w.reftype.value, w.mem_consumed, self._origins[key]) for key, w in self._live.items()]

    def _capture(self) -> None:
        self._pending = False
        self.at_peak = self.live()

    def device_peak(self) -> int:
        """Peak device (CPU) bytes of forward and backward (MemTracker's own peak may be the optimizer step's)."""
        return self._best

    def finish(self) -> None:
        """Take the last peak if nothing was freed after it."""
        if self._pending:
            self._capture()

    def host_peak(self) -> int:
        """Peak bytes on the host (meta) device."""
        return self._peak_mem.get(torch.device("meta"), 0)


# -- the cases -----------------------------------------------------------------------------------------------------
CUDA = torch.device("cuda")  # what the planner plans for and the engine resolves its choices on


@dataclass
class Built:
    """A fake model with the engine's surgery, its optimizer, one batch and its mask kwargs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    spec: Any  # PrecisionSpec
    batch: dict
    masks: dict
    chunk_size: int

    @property
    def device_optimizer(self) -> bool:
        """Whether the optimizer's states live on the device (not bf16_cpu_master's host AdamW)."""
        return not hasattr(self.optimizer, "host_bytes")


def build(case: Case, mode: contextlib.AbstractContextManager) -> Built:
    """The engine's model for `case` as run.py prepares it (load -> precision -> attention -> memory policy), on
    fake CPU tensors, with the stand-ins installed; its optimizer as the precision mode builds it on CUDA."""
    job = case.job()
    spec = precision_spec(job.precision.mode)
    hf_config = build_hf_config(job.model)
    with mode:
        model = load_model(job.model, torch.device("cpu"), spec.param_dtype)
    apply_precision(model, spec)
    apply_attention(model, resolve_attention_spec(job.attn, hf_config, device=CUDA))
    install_flex_stand_in(model)
    apply_memory_policy(model, block_memory_specs(case.memory, model.config.num_hidden_layers))
    host_on_meta(model)
    model.train()
    B, S = case.micro_batch, case.seq_len
    masks = mask_kwargs(model, torch.zeros(B, S, dtype=torch.int32))  # one document per row: every target valid
    with mode:
        optimizer = build_optimizer(model, dataclasses.replace(job.optim, name=spec.optimizer), CUDA)
        ids = torch.zeros(B, S, dtype=torch.long)
        batch = {
            "input_ids": ids,
            "position_ids": torch.arange(S).expand(B, S),
            "labels": ids,
            "predicting_index": torch.cat([torch.arange(S - 1) + row * S for row in range(B)]),
        }
    return Built(model, optimizer, spec, batch, masks, job.loss.chunk_size)


def forward(built: Built) -> Tensor:
    """The trainer's forward: under the precision's compute context, the summed token loss."""
    with built.spec.compute_context(torch.device("cpu")):  # CPU autocast: the same casts as CUDA's for these ops
        return engine_loss.forward_loss_sum(built.model, built.batch, built.chunk_size, **built.masks)


def tracked_step(case: Case, fake: bool = True) -> dict:
    """Peak device bytes of one step of `case` by MemTracker category, by phase and by origin; host peak.
    fake=False: real CPU tensors (a small model only: the test that fake and real steps track alike)."""
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with functional_loss(), eager_step(), fake_safe_offload():
        built = build(case, mode)
        with mode:  # the middle of a window: gradients allocated (as a backward leaves them) and optimizer states
            for param in built.model.parameters():
                param.grad = torch.zeros_like(param) if param.requires_grad else None
            built.optimizer.step()
        tracker = PeakTracker({id(p) for p in built.model.parameters()})
        tracker.track_external(built.model, *([built.optimizer] if built.device_optimizer else []))
        with mode, tracker:
            loss = forward(built)
            after_forward = tracker.live()  # what the forward holds for backward (and the static terms)
            loss.backward()
            del loss
            if built.device_optimizer:
                built.optimizer.step()
        tracker.finish()
    host = sum(built.optimizer.host_bytes().values()) if not built.device_optimizer else 0
    offloading = frozenset(i for i, spec in enumerate(applied(built.model).memory) if spec.offload)
    return {
        "peak_bytes": tracker.device_peak(),
        "at_peak": parts(tracker.at_peak, offloading),
        "after_forward": parts(after_forward, offloading),
        "phase_peaks": dict(tracker.phase_peaks),
        "host_offload_peak_bytes": tracker.host_peak(),
        "host_optimizer_bytes": host,
        "origins_at_peak": origins(tracker.at_peak),
        "live": {"after_forward": after_forward, "at_peak": tracker.at_peak},  # (type, bytes, Origin): diagnosis
    }


# -- what the tracker saw, in the planner's terms -----------------------------------------------------------------
_STATIC = {"Parameter": "weights", "Buffer": "weights", "Gradient": "grads", "Optstate": "optimizer"}
_BLOCK = re.compile(r"layers\.(\d+)")


def part_of(reftype: str, origin: Origin, offloading: frozenset = frozenset()) -> str:
    """The planner term a live storage belongs to: weights | grads | optimizer | compute_copy | blocks |
    offload_in_flight (made by a block that offloads: still on the device) | outside_blocks (forward, not in a
    decoder block) | backward (made in backward or its recompute) | optimizer_step (the step's temporaries)."""
    if reftype in _STATIC and origin.phase in ("before", "forward"):  # made before the step or tracked in it
        return _STATIC[reftype]
    if reftype in _STATIC:  # states made by the step (its first), or MemTracker calling its temporaries states
        return "optimizer_step"
    if origin.weight_copy:
        return "compute_copy"
    if origin.phase == "forward":
        block = _BLOCK.search(origin.module)
        if block is None:  # the embeddings' output is block 0's input: its checkpoint input, when it offloads
            first = origin.module.endswith("embed_tokens") and 0 in offloading
            return "offload_in_flight" if first else "outside_blocks"
        return "offload_in_flight" if int(block.group(1)) in offloading else "blocks"
    return {"optimizer": "optimizer_step"}.get(origin.phase, "backward")


def parts(live: list[tuple[str, int, Origin]], offloading: frozenset = frozenset()) -> dict[str, int]:
    """Bytes by planner term (`part_of`); offloading: the indices of the blocks that offload."""
    out: dict[str, int] = defaultdict(int)
    for reftype, nbytes, origin in live:
        out[part_of(reftype, origin, offloading)] += nbytes
    return dict(out)


def origins(live: list[tuple[str, int, Origin]], top: int = 80) -> list[tuple[str, int]]:
    """The largest groups of live bytes by (term, phase, module with block indices folded, op): the diagnosis."""
    out: dict[str, int] = defaultdict(int)
    for reftype, nbytes, origin in live:
        if reftype in _STATIC:
            continue
        module = _BLOCK.sub("layers.*", origin.module)
        out[f"{part_of(reftype, origin)} | {origin.phase} | {module} | {origin.op}"] += nbytes
    return sorted(out.items(), key=lambda kv: -kv[1])[:top]


# The planner holds when its total is within -2 % / +5 % of the tracker's peak (an estimate short of the peak risks
# an OOM, one over it only costs recompute) and its activations (with offload's blocks in flight) within 5 % of
# what the forward leaves on the device.
TOLERANCE = {"total_under": 0.02, "total_over": 0.05, "activations": 0.05}
# Eager op-level SAC keeps its cache outside autograd's saved tensors, where offload's hooks never see it: not what
# a GPU runs (compiled SAC blocks, whose saved tensors are offloaded). Reported, not held to the tolerance.
EAGER_ONLY = ("ops+offload",)


def compare(case: Case, tracked: Optional[dict] = None) -> dict:
    """The tracked step beside the planner's terms: term by term where the tracker attributes them, and in total
    (tracker: forward's and backward's device peak; planner: its device terms, no margin or CUDA context).
    tracked: `tracked_step(case)` if already run."""
    tracked = tracked if tracked is not None else tracked_step(case)
    planned = planner_step(case)
    at_peak, after_forward = tracked["at_peak"], tracked["after_forward"]
    terms = {name: at_peak.get(name, 0) for name in ("weights", "grads", "optimizer", "compute_copy")}
    terms["activations"] = after_forward.get("blocks", 0) + after_forward.get("outside_blocks", 0)
    terms["offload_in_flight"] = after_forward.get("offload_in_flight", 0)  # offloading blocks' still on the device
    terms["workspace"] = tracked["peak_bytes"] - sum(terms.values())  # the rest of the peak
    result = {
        "case": dataclasses.asdict(case),
        "label": case.label,
        "tracker": {"terms": terms, "total": tracked["peak_bytes"], **tracked},
        "planner": {k: v for k, v in planned.items() if k != "row"},
        "error": planned["total"] / tracked["peak_bytes"] - 1,  # > 0: the planner counts more than the tracker saw
        "held_to_tolerance": case.policy not in EAGER_ONLY,
    }
    result["failures"] = check(result) if result["held_to_tolerance"] else []
    return result


def check(result: dict, tolerance: Optional[dict] = None) -> list[str]:
    """Where the planner drifts past the tolerance (`TOLERANCE`) on a `compare` result; [] when it holds."""
    tol = tolerance or TOLERANCE
    failures = []
    if not -tol["total_under"] <= result["error"] <= tol["total_over"]:
        failures.append(f"total: planner {result['error']:+.1%} against the tracker's peak")
    # what the forward leaves on the device: activations and offload's blocks in flight (the tracker attributes a
    # tensor to the block that made it, the planner to the one that keeps it: one block's output can swap sides)
    held = ("activations", "offload_in_flight")
    planned = sum(result["planner"]["terms"][k] for k in held)
    tracked = sum(result["tracker"]["terms"][k] for k in held)
    if tracked and abs(planned / tracked - 1) > tol["activations"]:
        failures.append(f"activations: planner {planned / tracked - 1:+.1%} against what the forward holds")
    return failures
