"""torch.compile each decoder block (fullgraph), after memory wrappers and before FSDP; and a correct count of
what dynamo compiled.

Blocks share one graph: the memory wrappers are one class per HF class with the policy as data, so only blocks
with different policies (e.g. memory.layers=every_2) get a second graph. Counting: `counters["frames"]["ok"]`
is not incremented by fullgraph compiles (ConvertFrameAssert), so `CompileWatch` reads dynamo's per-compile
records (`get_compilation_metrics`, whose `recompile_reason` is set exactly when a frame is compiled again) and
the graph counter `counters["stats"]["unique_graphs"]`, which every compile increments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch import nn

from flexengine.core.errors import UserError
from flexengine.core.units import GiB
from flexengine.surgery.applied import applied
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.memory.layers import decoder_layers

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module, backend: Union[str, Callable] = "inductor") -> None:
    """Compile every decoder block in place (recorded in `model.flexengine.compile_backend`), each with a probe
    that counts the calls it ran uncompiled (BlockCompileProbe; verify_compiled_blocks reads it)."""
    layers = decoder_layers(model)
    # Python side effects inside a checkpointed block are not replayed by its recompute: without this dynamo
    # refuses them under the checkpoint HOP (with `kernels` installed, transformers' attention sets and resets
    # a ContextVar in every forward: "HOP: Unsafe side effect"); a set-and-reset needs no replay.
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    probe = BlockCompileProbe(needs_compiled_blocks(model), [0] * len(layers), [""] * len(layers))
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(probe.hook(i))  # before compile: it runs inside the compiled call
        # fullgraph: a graph break inside a block is a bug we want to see, not a silent slowdown
        layer.compile(backend=backend, fullgraph=True)
    record = applied(model)
    record.compile_backend = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
    record.compile_probe = probe
    log.info("compile: %d decoder blocks with backend=%s (fullgraph)", len(layers), backend)


def needs_compiled_blocks(model: nn.Module) -> Optional[str]:
    """Why the blocks must be compiled even with train.compile=false, or None.

    Op-level SAC saves flex's output only if it sees the flex_attention op: SAC's dispatch modes make dynamo
    skip a separately compiled flex, which then runs as the eager flex HOP (scores materialised) and is
    re-run in backward. Compiled inside the block, flex is one op of the block's graph and SAC's policy tags it
    must-save (torchtitan #1631).

    Op-level SAC with offload: eager SAC keeps its op outputs in its own cache, which offload's saved-tensor hooks
    never see, so they stay on the device (at 7B width and 8K rows, 23 such blocks keep 17.6 GiB the plan counts
    on the host). Compiled, they are the block graph's saved tensors and are offloaded as planned.
    """
    record = applied(model)
    cached = [spec.recompute for spec in record.memory if spec.offload and spec.recompute.cache_outside_autograd]
    if cached:
        return (
            f"memory.granularity={cached[0].name} with offload: only a compiled block hands what it keeps to "
            "offload's hooks"
        )
    attention = record.attention
    if attention is None or attention.backend is not AttnBackend.FLEX:
        return None
    kinds = [spec.recompute for spec in record.memory if spec.recompute.needs_flex_in_block_graph]
    if kinds:
        return (
            f"op-level SAC (memory.granularity={kinds[0].name}) with flex attention: SAC sees flex only inside a "
            "compiled block"
        )
    return None


@dataclass
class BlockCompileProbe:
    """Which compiled blocks ran uncompiled. Each block's forward pre-hook runs inside its compiled call: traced,
    `torch.compiler.is_compiling()` is true and the hook leaves nothing in the graph; run eagerly (dynamo skipped
    the frame: torch 2.11 does so silently even with fullgraph=True when every frame is skipped) it counts the
    call and records why, read at that moment (a dispatch mode, a stance, dynamo disabled)."""

    must: Optional[str]  # needs_compiled_blocks's reason: an uncompiled call is an error, not a slowdown
    eager_calls: list[int]
    why: list[str]  # the first uncompiled call's cause, per block
    checked: bool = field(default=False)

    def hook(self, i: int) -> Callable:
        """Block i's forward pre-hook."""

        def count_eager(module: nn.Module, args: tuple) -> None:
            if not torch.compiler.is_compiling():
                self.eager_calls[i] += 1
                self.why[i] = self.why[i] or why_uncompiled()

        return count_eager


def why_uncompiled() -> str:
    """Why dynamo would run a compiled frame eagerly right now, as far as torch's state tells."""
    from torch._dynamo.utils import get_compilation_metrics
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = [type(m).__name__ for m in _get_current_dispatch_mode_stack() if not m.is_infra_mode()]
    if modes:
        return f"a torch dispatch mode was active ({', '.join(modes)}): dynamo skips frames under one"
    if torch._dynamo.config.disable:
        return "torch._dynamo.config.disable is set (or TORCHDYNAMO_DISABLE=1)"
    stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")
    if stance != "default":
        return f"torch.compiler.set_stance({stance!r}) was in force"
    failed = [m for m in get_compilation_metrics() if getattr(m, "fail_reason", None)]
    if failed:
        return f"dynamo's last failed compile: {str(failed[-1].fail_reason).splitlines()[0][:300]}"
    return "dynamo skipped the frame without a recorded reason (TORCH_LOGS=+dynamo says why)"


def verify_compiled_blocks(model: nn.Module, host_bytes: Optional[int] = None) -> None:
    """After the first micro-batch: every compiled block ran compiled. A block that must be compiled
    (needs_compiled_blocks) and ran eagerly stops training with the block, the cause and the memory it costs
    (`host_bytes`: what the plan keeps on the host per micro-batch, which eager SAC would keep on the device);
    one that is compiled by choice only logs a warning (slower, not larger). Checked once per process."""
    probe = applied(model).compile_probe
    if probe is None or probe.checked:
        return
    probe.checked = True
    eager = [i for i, n in enumerate(probe.eager_calls) if n]
    if not eager:
        return
    said = f"decoder block {eager[0]} ({len(eager)} of {len(probe.eager_calls)} blocks) ran uncompiled"
    said += f": {probe.why[eager[0]]}"
    if probe.must is None:
        log.warning("compile: %s; training continues eagerly (slower)", said)
        return
    if host_bytes:
        cost = f"up to {host_bytes / GiB:.2f} GiB per micro-batch that the plan keeps on the host stay on the device"
    else:
        cost = "flex would run as the eager higher-order op (its scores materialised) and again in backward"
    raise UserError(
        f"compile: {said}. These blocks must run compiled ({probe.must}); uncompiled, {cost}. Remove what keeps "
        "dynamo from compiling them, or choose memory.granularity=block (no op-level SAC)."
    )


@dataclass
class CompileStats:
    """What dynamo compiled between `CompileWatch.start()` and `stats()`."""

    graphs: int  # graphs compiled (first compiles and recompiles)
    recompiles: int  # compiles of a frame that already had a graph (a guard failed)
    graph_breaks: int
    reasons: list  # the guard failures behind the recompiles (first line each)

    def as_dict(self) -> dict:
        """JSON-ready."""
        return {
            "graphs": self.graphs,
            "recompiles": self.recompiles,
            "graph_breaks": self.graph_breaks,
            "recompile_reasons": list(self.reasons),
        }


class CompileWatch:
    """Counts dynamo's compiles from a starting point on (nothing global is reset or reconfigured)."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        """Count from now."""
        from torch._dynamo.utils import counters, get_compilation_metrics

        self._graphs = counters["stats"]["unique_graphs"]
        self._breaks = sum(counters["graph_break"].values())
        # The records themselves, not their id()s: dynamo keeps only the newest 64, and a dropped record's id can
        # be reused by a new one, which an id set would then take for already seen (a recompile missed).
        self._seen = list(get_compilation_metrics())

    def stats(self) -> CompileStats:
        """What was compiled since `start()`."""
        from torch._dynamo.utils import counters, get_compilation_metrics

        seen = {id(m) for m in self._seen}  # safe: self._seen keeps these objects, so their ids stay theirs
        new = [m for m in get_compilation_metrics() if id(m) not in seen]
        reasons = [str(m.recompile_reason).splitlines()[0] for m in new if m.recompile_reason]
        return CompileStats(
            counters["stats"]["unique_graphs"] - self._graphs,
            len(reasons),
            sum(counters["graph_break"].values()) - self._breaks,
            reasons,
        )
