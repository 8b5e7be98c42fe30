"""What a plan may fill: the card's memory less what the caching allocator can never get (the CUDA context) and
less a named margin for what no tensor-bytes model sees.

The margin absorbs the caching allocator's fragmentation and block rounding (gradients freed each step and
reallocated between activation blocks of 64-180 MiB at 7B width: typically 2-5 % of the reserved memory near a
full card, less with expandable segments, which every entry point turns on), cuBLAS/cuBLASLt workspaces and
Inductor's buffers, and the planner's own error (its worst case against the project's meter and against
PyTorch's MemTracker: bench/results/memory.md, bench/results/planner_vs_memtracker.md). DeepSpeed's estimators
multiply by 1.5 instead; a fixed share is enough here because each term is itself measured. A plan compares its
allocated peak with `usable_bytes`; a run compares the allocator's `max_memory_reserved` with the planned peak
plus the margin (`reserved_limit_bytes`: the doctor, the GPU check) -- reserved beyond it means the margin was
too small.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexengine.core.config import HardwareConfig
from flexengine.core.units import GiB

MARGIN_FRACTION = 0.05  # of the card: fragmentation 2-5 % of reserved plus the planner's error (above)
MARGIN_FLOOR_BYTES = 3 * GiB  # on small cards the workspaces and one activation block's rounding dominate
# The CUDA context when no card is at hand to measure it: 0.5-0.8 GiB on the first CUDA call (PyTorch forum
# threads 73021 and 81330: 723 MiB and ~800 MiB); a run measures it (flexengine.core.hardware.cuda_context_gb).
ASSUMED_CUDA_CONTEXT_BYTES = int(0.8 * GiB)


@dataclass(frozen=True)
class DeviceBudget:
    """A device's memory split into what a plan may fill and what it must leave: card = context + margin +
    usable."""

    card_bytes: int  # what the device reports (a named card's figure, never above a real card's)
    context_bytes: int  # held outside the caching allocator: the CUDA context, other processes
    margin_bytes: int  # left free for fragmentation, workspaces and the planner's error

    @property
    def usable_bytes(self) -> int:
        """The planned allocated peak may reach this and no further."""
        return max(0, self.card_bytes - self.context_bytes - self.margin_bytes)

    def describe(self) -> str:
        """'79.15 GiB card - 0.80 context - 3.96 margin = 74.39 GiB budget' (only the card on a CPU)."""
        if not (self.context_bytes or self.margin_bytes):
            return f"{self.usable_bytes / GiB:.2f} GiB budget"
        return (
            f"{self.card_bytes / GiB:.2f} GiB card - {self.context_bytes / GiB:.2f} context - "
            f"{self.margin_bytes / GiB:.2f} margin = {self.usable_bytes / GiB:.2f} GiB budget"
        )


def default_margin_bytes(card_bytes: int) -> int:
    """hardware.memory_margin_gb=null on a GPU: max(5 % of the card, 3 GiB)."""
    return max(int(MARGIN_FRACTION * card_bytes), MARGIN_FLOOR_BYTES)


def device_budget(hardware: HardwareConfig) -> DeviceBudget:
    """The budget of a resolved HardwareConfig (memory_gb set). On a CPU the device is host memory: no CUDA
    context, and the OS returns freed pages, so no margin unless one is given."""
    if hardware.memory_gb is None:
        raise ValueError("device_budget needs a resolved HardwareConfig (memory_gb set): call resolve_hardware first")
    card = int(hardware.memory_gb * GiB)
    on_gpu = not hardware.on_cpu
    context = ASSUMED_CUDA_CONTEXT_BYTES if on_gpu else 0  # unless measured or given
    if hardware.cuda_context_gb is not None:
        context = int(hardware.cuda_context_gb * GiB)
    margin = default_margin_bytes(card) if on_gpu else 0
    if hardware.memory_margin_gb is not None:
        margin = int(hardware.memory_margin_gb * GiB)
    return DeviceBudget(card, context, margin)


def reserved_limit_bytes(planned_bytes: int, margin_bytes: int) -> int:
    """The most the caching allocator should reserve for a step planned at `planned_bytes` (allocated): the
    planned peak plus the margin left for what allocated excludes (fragmentation, block rounding, workspaces).
    A reserved peak past it means the margin was too small for this run. The doctor and the GPU check judge by it."""
    return planned_bytes + margin_bytes
