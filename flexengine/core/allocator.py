"""The CUDA caching allocator's configuration: expandable segments unless the user chose a configuration.

Without expandable segments the allocator makes one segment per cudaMalloc, and the blocks a step frees between
differently sized tensors (64-180 MiB activation blocks, gradients freed each step, ~400 MiB logit chunks) strand
slivers no later request fits. Expandable segments grow one segment per stream instead (PyTorch's Note [Expandable
Segments], c10/cuda/CUDACachingAllocator.cpp); torchtitan and torchtune train with them on.

PyTorch reads the variable when its CUDA library loads (recent versions parse it in a static initialiser), so it
must be in the environment before `import torch`: `flexengine/cli/__init__.py` calls `default_allocator_conf()`,
and every entry point lives in that package (the console scripts, `python -m flexengine.<command>`, torchrun's
workers, which run the same module), so it runs before any of them imports torch.

The names PyTorch reads (torch 2.13: c10/cuda/CUDAAllocatorConfig.h, c10/core/AllocatorConfig.h): PYTORCH_ALLOC_CONF
(the newer generic name, read first by the generic config), PYTORCH_CUDA_ALLOC_CONF (read first by the CUDA config)
and, on ROCm, PYTORCH_HIP_ALLOC_CONF. Any of them set, even to "", is the user's choice and nothing is added: a
second variable might override theirs, depending on the version's precedence. The default goes into
PYTORCH_CUDA_ALLOC_CONF, the name every supported torch (>= 2.6) reads.

Torch-free on purpose: composing a config must not import torch (tests/cli/test_common.py).
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping, Optional

ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
DEFAULT_NAME = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_ALLOC_CONF = "expandable_segments:True"
# The value flexengine put in PYTORCH_CUDA_ALLOC_CONF: a child process (a run started by a script that imported
# flexengine.cli) inherits both and still reports the default as flexengine's, not the user's.
DEFAULT_MARK = "FLEXENGINE_DEFAULT_ALLOC_CONF"
_SET_AFTER_TORCH = [False]  # this process set the default after torch was imported (PyTorch may have read none)


def default_allocator_conf(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Put PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in `environ` (default os.environ) unless the user set an
    allocator variable; True when it did."""
    env = os.environ if environ is None else environ
    if any(name in env for name in ALLOC_CONF_NAMES):
        return False
    env[DEFAULT_NAME] = env[DEFAULT_MARK] = DEFAULT_ALLOC_CONF
    if environ is None:
        _SET_AFTER_TORCH[0] = "torch" in sys.modules
    return True


def allocator_line(environ: Optional[MutableMapping[str, str]] = None) -> str:
    """The run's log line: the allocator configuration in force and whose it is (flexengine's default or yours)."""
    env = os.environ if environ is None else environ
    given = [(name, env[name]) for name in ALLOC_CONF_NAMES if name in env]
    if not given:  # library use: nothing went through flexengine/cli
        return (
            f"allocator: PyTorch's default, no expandable segments (set {DEFAULT_NAME}={DEFAULT_ALLOC_CONF} "
            "before Python starts to reduce fragmentation)"
        )
    if given == [(DEFAULT_NAME, env.get(DEFAULT_MARK))]:
        late = _SET_AFTER_TORCH[0] and environ is None
        return f"allocator: {given[0][1]} (flexengine default; set {DEFAULT_NAME} to change)" + (
            f"; set after torch was imported, so PyTorch may not use it: set {DEFAULT_NAME} before Python starts"
            if late
            else ""
        )
    return "allocator: " + ", ".join(f"{name}={value}" for name, value in given) + " (yours)"
