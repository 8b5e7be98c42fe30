"""Entry points: Hydra in, typed JobConfig out (train, plan, doctor, stats, sweep, copy).

Importing this package sets the CUDA allocator's default (expandable segments, unless the user set an allocator
variable): every entry point lives here, so this runs before any of them imports torch, which is when PyTorch
reads the variable (flexengine/core/allocator.py says why and which names count as the user's)."""

from flexengine.core.allocator import default_allocator_conf

default_allocator_conf()
