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
from dataclasses import dataclass
from typing import Callable, Optional, Union

from torch import nn

from flexengine.surgery.applied import applied
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.memory.layers import decoder_layers

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module, backend: Union[str, Callable] = "inductor") -> None:
    """Compile every decoder block in place (recorded in `model.flexengine.compile_backend`)."""
    layers = decoder_layers(model)
    for layer in layers:
        # fullgraph: a graph break inside a block is a bug we want to see, not a silent slowdown
        layer.compile(backend=backend, fullgraph=True)
    applied(model).compile_backend = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
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
