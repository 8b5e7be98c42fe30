"""The device's own speed, measured once and cached: what the planner turns FLOPs and bytes into seconds with when
it plans for the device it runs on (a card planned from elsewhere keeps its datasheet figures, marked assumed).

Measured, each in the compute dtype and at the shapes the caller names:
- matmul: a Linear's forward and both backward GEMMs (y = x @ w, dx = dy @ w.T, dw = x.T @ dy) at each of the
  model's GEMM shapes; FLOPs / seconds over all of them, weighted by how often each runs (`matmul_tflops`);
- attention: causal SDPA forward + backward at the model's heads, head_dim and row length, counted as the planner
  counts it (3 x the forward's 4 x H x S^2 x D x 1/2) (`attention_tflops`);
- memory bandwidth: a copy of a large tensor, read + write bytes / seconds (`memory_gb_s`);
- the optimizer: torch AdamW plus the gradient norm over as many elements as the caller asks, ns per parameter;
- one eager op's fixed cost (dispatch and autograd on tiny tensors), which uncompiled blocks pay per kernel;
- on CUDA, pinned host <-> device copies one way each and both at once on two streams (`h2d_gb_s`, `d2h_gb_s`,
  `duplex_gb_s`: each direction's rate while the other runs).

The cache (one JSON file, `cache_path()`) is keyed by device name, torch version, dtype and CPU threads; a GEMM
shape already measured under a key is not measured again. FLEXENGINE_SPEED_CACHE names another file (tests);
FLEXENGINE_DEVICE_SPEED=off measures nothing (the speed is then unknown and plans say so).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from flexengine.core.units import GiB, MiB

if TYPE_CHECKING:  # torch is imported where a measurement runs: composing a job (core/config.py) imports no torch
    import torch

log = logging.getLogger(__name__)

SPEED_ENV = "FLEXENGINE_DEVICE_SPEED"  # "off": measure nothing
CACHE_ENV = "FLEXENGINE_SPEED_CACHE"  # the cache file (default ~/.cache/flexengine/device_speed.json)
# "process": time this process's CPU seconds instead of the wall clock (CPU only; a machine shared with other jobs
# would otherwise lend their load to the measurement: bench/planner_time.py times its steps the same way)
CLOCK_ENV = "FLEXENGINE_SPEED_CLOCK"
MIN_TIMED_S = 0.05  # each figure is the best of several repeats of at least this long (a shared machine's noise)
REPEATS = 3
COPY_BYTES = {"cpu": 64 * MiB, "cuda": GiB}  # the bandwidth copy's size: beyond the caches
PINNED_BYTES = 256 * MiB
ATTENTION_MAX_S = 2048  # longer rows are measured at this length (the per-pair rate has settled by then)
# A GEMM is measured with at most this many token rows, and its [rows, n] output at most GEMM_MAX_OUTPUT elements
# (the loss's lm_head with loss.chunk_size=0 is tokens x vocab: tens of GB at 32K tokens); the rate has settled
# long before, and a 32K-context model on CPU would otherwise spend minutes here
GEMM_MAX_M = 4096
GEMM_MAX_OUTPUT = 1 << 26


@dataclass(frozen=True)
class Gemm:
    """One matmul of the model's step: x [m, k] @ w [k, n], run `count` times per forward."""

    m: int
    n: int
    k: int
    count: int = 1

    @property
    def measured_m(self) -> int:
        """The token rows the measurement runs (GEMM_MAX_M, GEMM_MAX_OUTPUT): its rate stands for all m."""
        return max(1, min(self.m, GEMM_MAX_M, GEMM_MAX_OUTPUT // max(self.n, 1)))

    @property
    def name(self) -> str:
        """The cache's name of the shape measured."""
        return f"{self.measured_m}x{self.n}x{self.k}"


@dataclass(frozen=True)
class AttentionShape:
    """Causal attention of one row: heads, query rows, head dim (the measured call's shape)."""

    heads: int
    seq_len: int
    head_dim: int

    @property
    def name(self) -> str:
        """The cache's name of the shape."""
        return f"attn{self.heads}x{min(self.seq_len, ATTENTION_MAX_S)}x{self.head_dim}"


@dataclass(frozen=True)
class DeviceSpeed:
    """Measured speed of one device in one dtype; None where not measured (CPU has no host link)."""

    matmul_tflops: float  # achieved over the model's GEMMs, forward + backward
    memory_gb_s: float  # copy bandwidth, read + write
    dtype_bytes: int  # the compute dtype's bytes per element (2: bf16, 4: fp32): the plans it applies to
    attention_tflops: Optional[float] = None  # causal SDPA forward + backward, as the planner counts its FLOPs
    optimizer_ns_per_param: Optional[float] = None  # AdamW step + gradient norm, per parameter
    op_us: Optional[float] = None  # one eager op's fixed cost (dispatch + autograd), forward or backward, in us
    h2d_gb_s: Optional[float] = None  # pinned host -> device
    d2h_gb_s: Optional[float] = None  # device -> pinned host
    duplex_gb_s: Optional[float] = None  # each direction while the other runs
    source: str = ""  # what was measured where, e.g. "measured on cpu (float32, 1 thread; cached in ...)"

    def as_dict(self) -> dict:
        """JSON-ready (the plan's assumptions, summary.json)."""
        return asdict(self)


def cache_path() -> Path:
    """The cache file: FLEXENGINE_SPEED_CACHE, else ~/.cache/flexengine/device_speed.json."""
    given = os.environ.get(CACHE_ENV)
    return Path(given) if given else Path.home() / ".cache" / "flexengine" / "device_speed.json"


def device_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a measurement holds for: the device's name, torch's version, the dtype and (CPU) the threads."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu {torch.get_num_threads()} thread(s)" + (
            " CPU time" if os.environ.get(CLOCK_ENV) == "process" else ""
        )
    return f"{name} | torch {torch.__version__} | {str(dtype).removeprefix('torch.')}"


def measure_device_speed(
    device: torch.device,
    dtype: torch.dtype,
    gemms: Sequence[Gemm],
    attention: Optional[AttentionShape] = None,
    optimizer_params: int = 0,
) -> Optional[DeviceSpeed]:
    """The device's speed at these shapes, from the cache where measured before (None: FLEXENGINE_DEVICE_SPEED=off).
    optimizer_params: elements to time AdamW over (0: not timed), capped at 8M (the step is linear in them)."""
    if os.environ.get(SPEED_ENV, "").lower() == "off" or not gemms:
        return None
    key, path = device_key(device, dtype), cache_path()
    cache = _read_cache(path)
    entry = cache.setdefault(key, {})
    todo = _measurements(device, dtype, gemms, attention, min(optimizer_params, 8 << 20))
    missing = {name: run for name, run in todo.items() if name not in entry}
    if missing:
        log.info("device speed: measuring this device's speed (once; cached in %s): %s", path, ", ".join(missing))
        import torch

        # the operands are random: drawn from a forked generator, so a run's seeded weights are the same whether
        # the speed was measured in this process or read from the cache
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for name, run in missing.items():
                entry[name] = run()
        release_measurement(device)
        _write_cache(path, cache)
        log.info("device speed: measured %s on %s (cached in %s)", ", ".join(missing), key, path)
    flops = sum(6 * g.m * g.n * g.k * g.count for g in gemms)
    seconds = sum(6 * g.m * g.n * g.k * g.count / (entry[g.name] * 1e12) for g in gemms)
    return DeviceSpeed(
        matmul_tflops=flops / seconds / 1e12,
        memory_gb_s=entry["memory_gb_s"],
        dtype_bytes=dtype.itemsize,
        attention_tflops=entry.get(attention.name) if attention is not None else None,
        optimizer_ns_per_param=entry.get("optimizer_ns_per_param"),
        op_us=entry.get("op_us"),
        h2d_gb_s=entry.get("h2d_gb_s"),
        d2h_gb_s=entry.get("d2h_gb_s"),
        duplex_gb_s=entry.get("duplex_gb_s"),
        source=f"measured on this machine ({key}; cached in {path})",
    )


def release_measurement(device: torch.device) -> None:
    """On CUDA: free the measurement's cached buffers and restart the peak counters, so the run's
    max_memory_reserved (the meter, the summary) holds the run's own memory, not the largest GEMM's operands."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _measurements(
    device: torch.device,
    dtype: torch.dtype,
    gemms: Sequence[Gemm],
    attention: Optional[AttentionShape],
    optimizer_params: int,
) -> dict[str, Callable[[], float]]:
    """Every figure these shapes need, by cache name, and how to measure it."""
    todo: dict[str, Callable[[], float]] = {}
    for g in gemms:
        todo[g.name] = functools.partial(_gemm_tflops, g, device, dtype)
    if attention is not None:
        todo[attention.name] = lambda: _attention_tflops(attention, device, dtype)
    todo["memory_gb_s"] = lambda: _copy_gb_s(device)
    todo["op_us"] = lambda: _op_us(device)
    if optimizer_params:
        todo["optimizer_ns_per_param"] = lambda: _optimizer_ns(optimizer_params, device, dtype)
    if device.type == "cuda":
        todo.update(_link_measurements(device))
    return todo


def clock() -> Callable[[], float]:
    """The timer measurements use: the wall clock, or this process's CPU time under FLEXENGINE_SPEED_CLOCK=process."""
    return time.process_time if os.environ.get(CLOCK_ENV) == "process" else time.perf_counter


def best_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """The fastest timing of fn after one warm-up call: calls batched to at least MIN_TIMED_S each, REPEATS of them
    (a shared machine's noise); a call slower than that is timed alone, and at most REPEATS times in all."""
    fn()
    _sync(device)
    now = clock()
    best, spent = float("inf"), 0.0
    for _ in range(REPEATS):
        loops = 1 if best == float("inf") else max(1, int(MIN_TIMED_S / max(best, 1e-9)))
        t0 = now()
        for _ in range(loops):
            fn()
        _sync(device)
        elapsed = now() - t0
        best, spent = min(best, elapsed / loops), spent + elapsed
        if spent > REPEATS * MIN_TIMED_S and loops == 1:  # slow calls: three are enough
            break
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _gemm_tflops(g: Gemm, device: torch.device, dtype: torch.dtype) -> float:
    """A Linear's three GEMMs at one shape (its token rows capped: Gemm.measured_m): 6 m n k FLOPs / seconds, in
    TFLOP/s."""
    import torch

    m = g.measured_m
    x = torch.randn(m, g.k, device=device, dtype=dtype)
    w = torch.randn(g.k, g.n, device=device, dtype=dtype)
    dy = torch.randn(m, g.n, device=device, dtype=dtype)

    def step() -> None:
        x @ w
        dy @ w.T
        x.T @ dy

    return 6 * m * g.n * g.k / best_seconds(step, device) / 1e12


def _attention_tflops(a: AttentionShape, device: torch.device, dtype: torch.dtype) -> float:
    """Causal SDPA forward + backward on one row, as 3 x the forward's causal FLOPs (the planner's count)."""
    import torch

    s = min(a.seq_len, ATTENTION_MAX_S)
    q, k, v = (torch.randn(1, a.heads, s, a.head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
    grad = torch.randn(1, a.heads, s, a.head_dim, device=device, dtype=dtype)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    flops = 3 * 4 * a.heads * s * s * a.head_dim * 0.5
    return flops / best_seconds(step, device) / 1e12


def _copy_gb_s(device: torch.device) -> float:
    """A large copy's read + write bytes / seconds, GB/s."""
    import torch

    n = COPY_BYTES["cuda" if device.type == "cuda" else "cpu"] // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), device) / 1e9


OP_CHAIN = 8  # ops in the timed chain (forward), each with its backward


def _op_us(device: torch.device) -> float:
    """The fixed cost of one eager op on tiny tensors, forward and backward (dispatch, autograd's bookkeeping): what
    an uncompiled block pays per kernel whatever its size, in us per op."""
    import torch

    x = torch.randn(16, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(OP_CHAIN // 2):
            y = torch.nn.functional.silu(y * 1.5)
        y.sum().backward()

    return best_seconds(chain, device) / (2 * (OP_CHAIN + 1)) * 1e6  # OP_CHAIN + the sum, each forward + backward


def _optimizer_ns(params: int, device: torch.device, dtype: torch.dtype) -> float:
    """torch AdamW's step plus the gradients' global norm (what every step runs), ns per parameter."""
    import torch

    sizes = [params // 8] * 8  # several tensors: the foreach path, as over a model's parameters
    weights = [torch.zeros(n, device=device, dtype=dtype, requires_grad=True) for n in sizes]
    for w in weights:
        w.grad = torch.full_like(w, 1e-3)
    opt = torch.optim.AdamW(weights, lr=1e-4)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        opt.step()

    return best_seconds(step, device) / sum(sizes) * 1e9


def _link_measurements(device: torch.device) -> dict[str, Callable[[], float]]:
    """Pinned host <-> device bandwidth, one way each and both ways at once (CUDA only)."""
    import torch

    n = PINNED_BYTES

    def buffers() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True), torch.empty(n, dtype=torch.uint8, device=device)

    def one_way(to_device: bool) -> float:
        host, dev = buffers()
        src, dst = (host, dev) if to_device else (dev, host)
        return n / best_seconds(lambda: dst.copy_(src, non_blocking=True), device) / 1e9

    def both() -> float:
        (host_a, dev_a), (host_b, dev_b) = buffers(), buffers()
        up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def copies() -> None:
            with torch.cuda.stream(up):
                dev_a.copy_(host_a, non_blocking=True)
            with torch.cuda.stream(down):
                host_b.copy_(dev_b, non_blocking=True)

        return n / best_seconds(copies, device) / 1e9

    return {"h2d_gb_s": lambda: one_way(True), "d2h_gb_s": lambda: one_way(False), "duplex_gb_s": both}


def _read_cache(path: Path) -> dict:
    """The cache's entries; an unreadable or foreign file is ignored (measured again), with a warning."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("device speed: ignoring the unreadable cache %s (%s); measuring again", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    """Write the cache atomically (a rename: concurrent runs never read half a file); a read-only home skips it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("device speed: could not cache the measurement in %s (%s)", path, e)
