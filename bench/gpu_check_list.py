"""The GPU checks of bench/gpu_check.sh, in the order they run: what decides the most first.

Standard library only: the driver (bench/gpu_check.py) reads this list before anything that could fail to
import. Each entry says what the check proves, the line it must pass, what it is expected to cost on one H200
(an estimate until a GPU run replaces it: cold compiles included, 16 host cores) and the broken variant it
catches; bench/README.md's table is printed from this list (`python bench/gpu_check_list.py`).

The decisive checks (env, the README's plan at the A100's budget, flex vs dense, planner vs allocator,
recompiles) come first and their estimates sum to at most DECISIVE_BUDGET_S cold; the others follow as time
allows (the driver never shortens a decisive check for them, and records them `not_run` when the call's budget
ends first).

How the estimates are made (no GPU has run these yet): what runs on the host (planning, the demo corpus, model
surgery) is the dry run's measured seconds for the same step (bench/results/gpu_check_dryrun.md, caches cleared,
on 2 shared cores: taken at face value, the device's 16 unshared cores being no slower); the compiles are
extrapolated per compiled graph, cold: COMPILE_S_PER_BLOCK_GRAPH for a decoder block's forward and backward
through Inductor and Triton (on the CPU the same block took 25-43 s to compile with flex and ~35 s without:
DESIGN.md's measurements, where C++ compiles in place of Triton's parallel workers), COMPILE_S_PER_FLEX for flex's
forward and backward kernels at one shape and mask, COMPILE_S_PER_OPTIMIZER_GRAPH for one of torchao's per-shape
AdamW graphs; the steps are the planner's H200 step time. Each entry's `basis` says which of these it adds up.
"""

from __future__ import annotations

from dataclasses import dataclass

CALL_BUDGET_S = 470  # the whole device call (wheels, probes, checks); bench/gpu_check.sh's default, within its 480 s
DECISIVE_BUDGET_S = 300  # the decisive checks' estimates, cold, add up to at most this
# The driver's cap of a check: up to 2x its estimate while the decisive checks after it keep RESERVE of their
# estimates in the time left, never below its proportional share of that time (bench/gpu_check.py: check_cap).
# With the call's 450 s for checks (END_S kept for the summary) and the decisive estimates' 290 s, every decisive
# check finishes when each is SLOW_COMPILES x its estimate (cold compiles that much slower than extrapolated), and
# a check that hangs until its cap still leaves the decisive checks after it their full estimates.
RESERVE = 1.0
SLOW_COMPILES = 1.5
DEAD_DEVICE_EXIT = 75  # the worker's exit status when the device died in a check: the driver starts a fresh one
# Cold compile seconds on one H200 with 16 host cores, extrapolated (module docstring): Inductor + Triton for one
# decoder block's forward and backward (flex inside compiled separately, below); flex's forward + backward Triton
# kernels at one shape, dtype and mask; one of torchao's per-parameter-shape optimizer graphs (pointwise only).
COMPILE_S_PER_BLOCK_GRAPH = 25
COMPILE_S_PER_FLEX = 15
COMPILE_S_PER_OPTIMIZER_GRAPH = 4


@dataclass(frozen=True)
class Check:
    """One check of bench/gpu_check.sh."""

    name: str
    proves: str
    passes_if: str
    expected_s: int  # on one H200, estimated (no GPU run yet), cold compiles included
    catches: str  # a deliberately broken variant this check fails on
    cpu_part: str  # what `--dry-run` runs of it on a CPU
    basis: str = ""  # how expected_s was made: measured host seconds + extrapolated compiles + planned steps
    decisive: bool = False  # among the first checks, whose estimates fit DECISIVE_BUDGET_S

    @property
    def cap_s(self) -> int:
        """Its cap (s) when the budget is on schedule: 2x the estimate, at least 45 s (bench/gpu_check.py's
        check_cap lowers it when checks after it would lose their turn, and raises it when time was saved)."""
        return max(45, 2 * self.expected_s)


def _train_checks(modes: tuple[tuple[str, int, str], ...]) -> tuple[Check, ...]:
    """train_<mode> for each (mode, estimated seconds, basis of the estimate)."""
    return tuple(
        Check(
            f"train_{mode}",
            f"precision={mode} trains through the real loop (build_trainer + train_step: plan, demo data, flex, "
            "packed 8K rows) at 7B width, 4 layers; tokens/s, MFU and peak memory against the planner's bytes and "
            "step time for this mode (bf16_sr and bf16_mixed after the decisive checks; bf16_cpu_master, fp32, "
            "bf16_pure after doctor)",
            "1 warm-up + 3 steps with finite loss and grad norm; 0.8 x the planner's device bytes <= "
            "max_memory_allocated <= 1.10 x them; max_memory_reserved <= planned + the plan's margin; no cudaMalloc "
            "retry; measured / planned step time reported, not judged",
            seconds,
            "a mode that crashes at step 1 (the torchao lr-tensor crash of bf16_sr), a planner that under-counts "
            "the mode's bytes by > 10 % or over-counts them by > 25 %",
            "plans the 7B-width job for one H200 (the numbers the GPU run is held against); runs the mode for "
            "1 + 1 steps through the same loop on a tiny LLaMA (attn.backend=varlen)",
            basis,
        )
        for mode, seconds, basis in modes
    )


# bf16_sr reuses readme_a100's flex kernels (8K, head dim 128, bf16) and most of its torchao graphs; each mode
# compiles its own block graph (the parameters' dtype differs); fp32 also its own flex kernels.
FIRST_MODES = (
    ("bf16_sr", 40, "host 8 s + 1 block graph 25 s + 1 new optimizer graph (vocab 32000) 4 s + 4 steps ~1 s"),
    ("bf16_mixed", 35, "host 8 s + 1 block graph 25 s + 4 steps ~1 s (fused AdamW: no optimizer graph)"),
)
LATER_MODES = (
    ("bf16_cpu_master", 40, "host 8 s + 1 block graph 25 s + 4 steps with a host AdamW of 1.4 s each"),
    ("fp32", 50, "host 8 s + 1 block graph 25 s + fp32 flex 15 s + 4 steps ~0.5 s"),
    ("bf16_pure", 35, "host 8 s + 1 block graph 25 s + 4 steps ~1 s"),
)


# 7B width = llama2_7b's hidden 4096 / intermediate 11008 / 32 heads, fewer layers (static terms stay exact).
CHECKS: tuple[Check, ...] = (
    Check(
        "env",
        "the image's python3 imports torch, transformers, hydra, omegaconf, torchao and every flexengine module "
        "the checks use, and sees the GPU; records the CUDA context before any allocation and the call's "
        "allocator and compile-cache settings",
        "all imports succeed and torch.cuda.is_available()",
        10,
        "a missing carried wheel (e.g. no omegaconf) or a CPU-only torch",
        "the same imports; CUDA not required",
        "the dry run's import time (torch, transformers, flexengine), no compile",
        decisive=True,
    ),
    Check(
        "readme_a100",
        "the README's headline run, experiment=deepseek7b_6k_a100, exactly as the planner plans it for one "
        "A100-80G (precision=auto's mode, memory=auto's policy, micro-batch, compile as configured; 30 layers at 7B "
        "width, random weights built on the GPU, packed 8K rows; grad_accum 2, the plan recomputed for it and "
        "making the README's choices), on the H200 capped with set_per_process_memory_fraction at what an A100's "
        "allocator can get (the plan's card less its CUDA context), 1 warm-up + 3 optimizer steps through "
        "build_trainer + train_step; max_memory_reserved and max_memory_allocated against the plan's total, "
        "static (weights + optimizer) and within-step (gradients, activations, workspaces) terms; step time and "
        "MFU against the plan's, with the expected H200/A100 ratio",
        "no OOM and no cudaMalloc retry at the cap; finite steps; 0.85 x the plan <= max_memory_allocated <= 1.10 x "
        "the plan; max_memory_reserved <= planned + the plan's margin; no must-compile block run uncompiled; "
        "offload moving >= 0.5 x the plan's bytes per step; compile counts, offload traffic and pinned bytes, host "
        "memory and a 1 GiB pinned PCIe bandwidth recorded; step time and MFU reported against the planner's H200 "
        "step for the same choices (compute 0.32x, HBM 0.42x, PCIe offload unscaled) and the assumed 40 %, not "
        "judged",
        120,
        "a plan that fills the card (the old 79.0 of 79.3 GiB with a 1 GiB flat reserve): OOM or retries at the "
        "cap; a planner under-counting the step by > 10 % or over-counting it by > 15 %; blocks that ran "
        "uncompiled (SAC's cache kept on the device)",
        "plans the README's job (the planner CLI's build_plan) at grad_accum 8 and 2 (same choices), re-plans the "
        "pinned overrides (same plan), builds the 30-layer model on meta with the run's own constructor (its bytes "
        "= the plan's weights), computes the cap for an H200's 139.8 GiB and the expected H200 step, runs the "
        "pinned job at full depth and a tiny width for 1 + 1 steps on the CPU, and fills the report's fields",
        "host 15 s (the dry run: plans 7 s, trainer built 4 s; on the GPU also 12.9 GiB of weights initialised "
        "and the demo corpus tokenized cold) + 2 block graphs (SAC-ops + offload, plain) 50 s + flex at 8K 15 s + 5 "
        "torchao optimizer graphs (one per parameter shape; the dry run compiles its 5 in 55 s of C++ on 2 shared "
        "cores) 20 s + 4 steps of grad_accum 2 at the planner's H200 3.5 s = 14 s; 114 s, rounded up",
        decisive=True,
    ),
    Check(
        "flex_vs_dense",
        "FlexAttention forward and backward equal the dense-mask reference on packed documents (packed_doc and "
        "packed_sliding, fp32 and bf16): the kernels the engine trains with compute the masked attention",
        "relative logits and per-parameter gradient differences < 2e-3 (fp32) / 3e-2 (bf16)",
        45,
        "flex given a wrong mask (causal only, documents not separated) against the dense document mask: logits "
        "0.82 apart (the summed loss only 6e-4 at random init, inside tolerance: the check reads the logits)",
        "the comparator on the forward (CPU flex has no backward): right mask passes, causal-only mask fails",
        "4 flex kernel sets (2 masks x 2 dtypes) at a tiny head dim, ~10 s each (smaller than 7B's), + host 5 s",
        decisive=True,
    ),
    Check(
        "planner_vs_allocator",
        "the planner's device bytes match torch.cuda.max_memory_allocated, and max_memory_reserved stays within "
        "them plus the plan's margin, over real training steps at 7B width, 8 layers, 32K rows, memory=none and "
        "memory=full (bf16_mixed)",
        "|planned - measured| / measured < 10 % for both policies, reserved <= planned + margin, no cudaMalloc "
        "retry, and halving the planner's activation term moves memory=none's total by more than the tolerance "
        "(the check can see an activation error)",
        75,
        "a planner with the activation term halved: it moves the planned total by 31 % at 8 layers and 32K (by 12 % "
        "at 2 layers and 8K, 15 % at 8 layers and 8K: barely past the tolerance)",
        "the planner's sensitivity at those GPU shapes; on a CPU LLaMA (8 layers of hidden 512, 2K) the same "
        "comparison against real tensor bytes + the peak of live tensors in a forward and backward: the planner "
        "passes, the halved planner fails",
        "host 10 s + 2 block graphs (none, full) 50 s + flex at 32K 15 s; 2 x 2 steps at 32K ~0.5 s each",
        decisive=True,
    ),
    Check(
        "recompiles",
        "train.compile=true (inductor blocks with flex inside, op-level SAC) trains 5 steps of new document "
        "layouts after warm-up without one recompile or graph break (CompileWatch)",
        "graphs == recompiles == graph_breaks == 0 after the warm-up step, over >= 3 distinct layouts",
        40,
        "a row of another length (a shape guard fails): CompileWatch must count the recompile (shown in the dry "
        "run; on the GPU it would cost a second cold inductor compile)",
        "the same loop with aot_eager and attn.backend=dense: 0 recompiles over new layouts; a row of another "
        "length counted as a recompile",
        "host 5 s (tiny model, demo data) + 1 block graph with SAC 25 s (tiny: less) + flex at 2K (packed_doc, "
        "bf16: flex_vs_dense's kernel at another length) 10 s; 6 fast steps",
        decisive=True,
    ),
    *_train_checks(FIRST_MODES),
    Check(
        "offload_overlap",
        "memory=offload at 7B width, 8K (4 layers): activation copies are pinned, on a side stream, and overlap "
        "compute kernels; the batch host->device copies are pinned",
        "overlapped copy time >= 0.5 x min(copy time, compute time on other streams), no pageable copy, a copy "
        "stream other than the compute stream, every HtoD batch copy Pinned",
        35,
        "copies on the compute stream (no side stream) or serialised with compute (prefetch not running ahead)",
        "the trace reader on synthetic timelines: overlapped passes, same-stream and serialised fail; the "
        "planner's copy bytes per block at 7B width 8K vs hidden 1024 4K",
        "host 8 s + 1 block graph (offload hooks around it) 25 s + 2 steps with a profiled one",
    ),
    Check(
        "cp_grads",
        "context parallelism's flex math on one GPU: torch's CP BlockMask per virtual rank (PTRR-balanced), "
        "flex backward, dK/dV summed over ranks == unsharded flex; with 2 GPUs also a parallel.cp=2 training "
        "step's gradients == one process",
        "relative gradient errors < 1e-4 and equal attended blocks summed over ranks; 'skipped: torch X lacks Y' "
        "when this torch has no such private API",
        25,
        "a rank's queries left in the PTRR order (not restored): gradients land on the wrong tokens",
        "probes torch's private CP API; forward of each virtual rank vs unsharded (S=1024)",
        "flex kernels for the CP block masks at 4K (head dim 128, fp32) 15 s + host 5 s",
    ),
    Check(
        "doctor",
        "`flexengine.doctor` on the GPU (tiny model, flex): a healthy packed run is reported healthy",
        "attn_backend == flex, recompiles_after_warmup == 0, graph_breaks == 0",
        20,
        "a layout-dependent recompile (its count comes from CompileWatch, proven by `recompiles`)",
        "the doctor on the CPU (varlen), 1 warm-up + 1 step",
        "recompiles' kernels from the cache (tiny model, 2K), host 5 s, 4 steps",
    ),
    *_train_checks(LATER_MODES),
    Check(
        "flex_vs_sdpa",
        "a packed row through compiled flex beats the same documents padded 4 per batch through HF SDPA, at 8K "
        "and 32K, 7B width, 2 layers (every layer alike: the ratio is per layer), every block recomputed: useful "
        "tokens/s of both and peak memory",
        "flex_packed / sdpa_padded speedup > 1 at both lengths",
        30,
        "a flex path that materialises scores (uncompiled flex) or a mask that schedules every block",
        "builds the packed and padded batches of the same documents and runs both sides at S=512 on a tiny "
        "model (varlen in place of flex)",
        "flex at 8K and 32K from the cache (bf16, head dim 128) + eager SDPA; 2 x 3 steps per side",
    ),
    Check(
        "fsdp_smoke",
        "FSDP2 under torchrun with one process (fully_shard per block + root, bf16 params, fp32 reduce) trains, "
        "gathers the full state dict and writes an HF checkpoint",
        "exit 0, finite final loss, summary.json and a checkpoint with safetensors",
        30,
        "a sharded save that writes no weights or a run that exits non-zero",
        "the same command on gloo/CPU (debug=fast, hardware=cpu)",
        "the dry run's 33 s on 2 CPU cores (torchrun start-up, imports, a tiny model) taken as is",
    ),
    Check(
        "precision_proof",
        "precision=bf16_mixed follows fp32 over 12 steps at lr 2e-5 on a 32-layer LLaMA with CUDA's bf16 kernels "
        "and fused AdamW, and bf16_pure fails the same test",
        "tests/gpu/test_gpu_precision.py's tolerances (loss 1 %, update slope and norm ratio in (0.9, 1.1))",
        10,
        "bf16_pure (updates round away against bf16 weights) must fail it",
        "none here (tests/surgery/test_precision.py is its CPU twin in CI)",
        "eager, small: 3 x 12 steps of a narrow 32-layer LLaMA",
    ),
)
BY_NAME = {c.name: c for c in CHECKS}


def markdown_table() -> str:
    """The checks as a Markdown table (bench/README.md)."""
    head = "| # | check | what it proves | passes if | H200 s (est., cold) | how estimated | broken variant it catches"
    head += " |"
    rows = [head]
    rows.append("|---|---|---|---|---|---|---|")
    for i, c in enumerate(CHECKS):
        name = f"`{c.name}`" + (" (decisive)" if c.decisive else "")
        rows.append(f"| {i} | {name} | {c.proves} | {c.passes_if} | {c.expected_s} | {c.basis} | {c.catches} |")
    return "\n".join(rows)


def decisive_seconds() -> int:
    """The decisive checks' estimates, cold, added up."""
    return sum(c.expected_s for c in CHECKS if c.decisive)


if __name__ == "__main__":
    print(markdown_table())
    total = sum(c.expected_s for c in CHECKS)
    print(
        f"\nestimates: decisive checks {decisive_seconds()} s (of {DECISIVE_BUDGET_S} s), all {total} s; the call's "
        f"budget {CALL_BUDGET_S} s (the checks past it are recorded not_run)"
    )
