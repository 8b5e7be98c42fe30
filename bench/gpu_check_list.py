"""The GPU checks of bench/gpu_check.sh, in the order they run: what decides the most first.

Standard library only: the driver (bench/gpu_check.py) reads this list before anything that could fail to
import. Each entry says what the check proves, the line it must pass, what it is expected to cost on one H200
(an estimate until a GPU run replaces it: cold compiles included, 16 host cores) and the broken variant it
catches; bench/README.md's table is printed from this list (`python bench/gpu_check_list.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

CALL_BUDGET_S = 400  # the whole device call (wheels, probes, checks); bench/gpu_check.sh's default, <= 7 minutes
MARGIN = 0.15  # the estimates leave this share of CALL_BUDGET_S free: they are guesses until a GPU run
# The driver's cap of a check: up to 2x its estimate while the checks after it keep RESERVE of their estimates in
# the time left, never below its proportional share of that time (bench/gpu_check.py: check_cap).
RESERVE = 0.75


@dataclass(frozen=True)
class Check:
    """One check of bench/gpu_check.sh."""

    name: str
    proves: str
    passes_if: str
    expected_s: int  # on one H200, estimated (no GPU run yet), compiles included
    catches: str  # a deliberately broken variant this check fails on
    cpu_part: str  # what `--dry-run` runs of it on a CPU

    @property
    def cap_s(self) -> int:
        """Its cap (s) when the budget is on schedule: 2x the estimate, at least 45 s (bench/gpu_check.py's
        check_cap lowers it when checks after it would lose their turn, and raises it when time was saved)."""
        return max(45, 2 * self.expected_s)


def _train_checks(modes: tuple[tuple[str, int], ...]) -> tuple[Check, ...]:
    """train_<mode> for each (mode, estimated seconds)."""
    return tuple(
        Check(
            f"train_{mode}",
            f"precision={mode} trains through the real loop (build_trainer + train_step: plan, demo data, flex, "
            "packed 8K rows) at 7B width, 4 layers; tokens/s, MFU and peak memory against the planner's bytes and "
            "step time for this mode (bf16_sr, precision=auto's pick for the README experiment, and bf16_mixed "
            "before the other checks; bf16_cpu_master, fp32, bf16_pure after doctor)",
            "1 warm-up + 3 steps with finite loss and grad norm, and 0.8 x the planner's device bytes (its CUDA "
            "reserve left out) <= max_memory_allocated <= 1.10 x them; measured / planned step time reported, not "
            "judged",
            seconds,
            "a mode that crashes at step 1 (the torchao lr-tensor crash of bf16_sr), a planner that under-counts "
            "the mode's bytes by > 10 % or over-counts them by > 25 %",
            "plans the 7B-width job for one H200 (the numbers the GPU run is held against); runs the mode for "
            "1 + 1 steps through the same loop on a tiny LLaMA (attn.backend=varlen)",
        )
        for mode, seconds in modes
    )


# seconds: bf16_sr, first, pays the bf16 flex compile at 7B width and 8K, the demo data and torchao's compiled
# AdamW step (one graph per parameter shape); bf16_mixed reuses the kernels; fp32 compiles its own flex kernels.
FIRST_MODES = (("bf16_sr", 50), ("bf16_mixed", 10))
LATER_MODES = (("bf16_cpu_master", 15), ("fp32", 25), ("bf16_pure", 10))


# 7B width = llama2_7b's hidden 4096 / intermediate 11008 / 32 heads, fewer layers (static terms stay exact).
CHECKS: tuple[Check, ...] = (
    Check(
        "env",
        "the image's python3 imports torch, transformers, hydra, omegaconf, torchao and every flexengine module "
        "the checks use, and sees the GPU",
        "all imports succeed and torch.cuda.is_available()",
        10,
        "a missing carried wheel (e.g. no omegaconf) or a CPU-only torch",
        "the same imports; CUDA not required",
    ),
    *_train_checks(FIRST_MODES),
    Check(
        "flex_vs_dense",
        "FlexAttention forward and backward equal the dense-mask reference on packed documents (packed_doc and "
        "packed_sliding, fp32 and bf16): the kernels the engine trains with compute the masked attention",
        "relative logits and per-parameter gradient differences < 2e-3 (fp32) / 3e-2 (bf16)",
        20,
        "flex given a wrong mask (causal only, documents not separated) against the dense document mask: logits "
        "0.82 apart (the summed loss only 6e-4 at random init, inside tolerance: the check reads the logits)",
        "the comparator on the forward (CPU flex has no backward): right mask passes, causal-only mask fails",
    ),
    Check(
        "recompiles",
        "train.compile=true (inductor blocks with flex inside, op-level SAC) trains 5 steps of new document "
        "layouts after warm-up without one recompile or graph break (CompileWatch)",
        "graphs == recompiles == graph_breaks == 0 after the warm-up step, over >= 3 distinct layouts",
        35,
        "a row of another length (a shape guard fails): CompileWatch must count the recompile (shown in the dry "
        "run; on the GPU it would cost a second cold inductor compile)",
        "the same loop with aot_eager and attn.backend=dense: 0 recompiles over new layouts; a row of another "
        "length counted as a recompile",
    ),
    Check(
        "planner_vs_allocator",
        "the planner's device bytes (minus its CUDA reserve) match torch.cuda.max_memory_allocated over real "
        "training steps at 7B width, 8 layers, 32K rows, memory=none and memory=full (bf16_mixed)",
        "|planned - measured| / measured < 10 % for both policies, and halving the planner's activation term "
        "moves memory=none's total by more than the tolerance (the check can see an activation error)",
        35,
        "a planner with the activation term halved: it moves the planned total by 28 % at 8 layers and 32K (by 10 % "
        "at 2 layers and 8K, 13 % at 8 layers and 8K: inside or at the tolerance)",
        "the planner's sensitivity at those GPU shapes; on a CPU LLaMA (8 layers of hidden 512, 2K) the same "
        "comparison against real tensor bytes + the peak of live tensors in a step: the planner passes, the "
        "halved planner fails",
    ),
    Check(
        "offload_overlap",
        "memory=offload at 7B width, 8K (4 layers): activation copies are pinned, on a side stream, and overlap "
        "compute kernels; the batch host->device copies are pinned",
        "overlapped copy time >= 0.5 x min(copy time, compute time on other streams), no pageable copy, a copy "
        "stream other than the compute stream, every HtoD batch copy Pinned",
        15,
        "copies on the compute stream (no side stream) or serialised with compute (prefetch not running ahead)",
        "the trace reader on synthetic timelines: overlapped passes, same-stream and serialised fail; the "
        "planner's copy bytes per block at 7B width 8K vs hidden 1024 4K",
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
    ),
    Check(
        "doctor",
        "`flexengine.doctor` on the GPU (tiny model, flex): a healthy packed run is reported healthy",
        "attn_backend == flex, recompiles_after_warmup == 0, graph_breaks == 0",
        20,
        "a layout-dependent recompile (its count comes from CompileWatch, proven by `recompiles`)",
        "the doctor on the CPU (varlen), 1 warm-up + 1 step",
    ),
    *_train_checks(LATER_MODES),
    Check(
        "flex_vs_sdpa",
        "a packed row through compiled flex beats the same documents padded 4 per batch through HF SDPA, at 8K "
        "and 32K, 7B width, 2 layers (every layer alike: the ratio is per layer), every block recomputed: useful "
        "tokens/s of both and peak memory",
        "flex_packed / sdpa_padded speedup > 1 at both lengths",
        20,
        "a flex path that materialises scores (uncompiled flex) or a mask that schedules every block",
        "builds the packed and padded batches of the same documents and runs both sides at S=512 on a tiny "
        "model (varlen in place of flex)",
    ),
    Check(
        "fsdp_smoke",
        "FSDP2 under torchrun with one process (fully_shard per block + root, bf16 params, fp32 reduce) trains, "
        "gathers the full state dict and writes an HF checkpoint",
        "exit 0, finite final loss, summary.json and a checkpoint with safetensors",
        30,
        "a sharded save that writes no weights or a run that exits non-zero",
        "the same command on gloo/CPU (debug=fast, hardware=cpu)",
    ),
    Check(
        "precision_proof",
        "precision=bf16_mixed follows fp32 over 12 steps at lr 2e-5 on a 32-layer LLaMA with CUDA's bf16 kernels "
        "and fused AdamW, and bf16_pure fails the same test",
        "tests/gpu/test_gpu_precision.py's tolerances (loss 1 %, update slope and norm ratio in (0.9, 1.1))",
        10,
        "bf16_pure (updates round away against bf16 weights) must fail it",
        "none here (tests/surgery/test_precision.py is its CPU twin in CI)",
    ),
)
BY_NAME = {c.name: c for c in CHECKS}


def markdown_table() -> str:
    """The checks as a Markdown table (bench/README.md)."""
    rows = ["| # | check | what it proves | passes if | H200 s (est.) | broken variant it catches |"]
    rows.append("|---|---|---|---|---|---|")
    for i, c in enumerate(CHECKS):
        rows.append(f"| {i} | `{c.name}` | {c.proves} | {c.passes_if} | {c.expected_s} | {c.catches} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
    total = sum(c.expected_s for c in CHECKS)
    print(f"\nsum of estimates: {total} s of the call's {CALL_BUDGET_S} s ({1 - total / CALL_BUDGET_S:.0%} free)")
