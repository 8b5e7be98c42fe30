"""One resolution of a job: hardware -> attention spec -> row length -> fit -> parallel spec, in that order, once.

`resolve` is the sequence every caller shares: the training run (which knows its device, process group, measured
speed and training documents), the plan command (a named card, or this machine), the corpus-time answer and the
bench scripts. Its answer, `ResolvedRun`, is a frozen value holding what each later stage reads: the concrete
hardware, the Attention/Parallel/Precision specs, the per-block MemorySpecs, the batch shape and the FitPlan.
`record_resolution` writes its choices into a ConfigRecord: the record says what runs because it reads this value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from flexengine.core.config import HardwareConfig, JobConfig, PrecisionConfig, check_fixed_rope
from flexengine.core.config_record import (
    AUTO_ATTENTION_BACKEND,
    AUTO_HARDWARE,
    AUTO_PLANNER,
    AUTO_ROW_LENGTH,
    FROM_MODEL_PATH,
    ConfigRecord,
)
from flexengine.core.device_speed import measure_device_speed
from flexengine.core.hardware import assumed_hardware, plans_this_machine, resolve_hardware
from flexengine.core.parallel_spec import ParallelSpec, resolve_parallel
from flexengine.planning.costs import speed_shapes
from flexengine.planning.fit import FitPlan, plan_job, plan_specs
from flexengine.planning.plan import Plan
from flexengine.planning.row_length import Documents, RowLengthChoice, choose_row_length
from flexengine.planning.shapes import AttendedPairs, ModelShape, PlanInputs
from flexengine.planning.specs import PlanSpecs, context_rows, plan_inputs, planned_attention
from flexengine.surgery.attention.job_rules import packs_documents, resolve_attention_rules
from flexengine.surgery.attention.spec import AttentionSpec
from flexengine.surgery.memory.spec import MemorySpec
from flexengine.surgery.model_files import architecture_of
from flexengine.surgery.precision import PrecisionSpec, auto_order, precision_spec
from flexengine.surgery.rope import context_limits

if TYPE_CHECKING:
    import torch

# the attended pairs of a known corpus's packed rows: a count, or one computed at the resolved row length
PairsOf = Callable[[JobConfig, AttentionSpec], Optional[AttendedPairs]]


@dataclass(frozen=True)
class ResolvedRun:
    """A job resolved on concrete hardware: what every stage after planning reads."""

    planned: JobConfig  # the job as planned: the caller's, at the resolved row length
    job: JobConfig  # `planned` with the fit's answers (resolved_job): the one derived copy the loop reads
    hf_config: object  # the model's HF config (PretrainedConfig)
    hardware: HardwareConfig  # concrete: device, memory budgets, world size, measured speed where measured
    attention: AttentionSpec
    parallel: ParallelSpec  # parallel.* as enums, reduce_every as the fit chose it
    fit: FitPlan  # the fit's answers, with every precision mode it weighed; the fields below are read from it
    plan: Plan  # the planner's answer under the chosen precision
    precision: PrecisionSpec
    memory_specs: tuple[MemorySpec, ...]  # the chosen memory policy, one MemorySpec per decoder block
    micro_batch: int  # rows per micro-batch
    grad_accum: int  # micro-batches per optimizer step
    seq_len: int  # tokens per row
    rows: Optional[RowLengthChoice] = None  # data.seq_len=auto over documents: every length weighed
    pairs: Optional[AttendedPairs] = None  # the corpus's packed rows' count (None: whole-row documents)
    auto_seq_len: bool = False  # data.seq_len=auto was resolved here (from documents or the model's context)

    def specs(self, of: Optional[JobConfig] = None) -> PlanSpecs:
        """The PlanSpecs of what runs (the fit's batch shape); of: another variant of the job on the same
        resolution (the job as planned at its given batch, or at another LoRA rank)."""
        return plan_specs(self.job if of is None else of, self.hf_config, self.attention, self.pairs)

    def inputs(self, batch_of: Optional[JobConfig] = None) -> PlanInputs:
        """The PlanInputs of what runs (the fit's batch shape); batch_of: another job's micro-batch and
        accumulation on the same resolution (the job as planned, for a table at its given batch)."""
        return plan_inputs(self.specs(batch_of), self.hardware, self.precision)


def resolve_target_hardware(
    job: JobConfig, hf_config, device: Optional[torch.device] = None, world_size: int = 1
) -> HardwareConfig:
    """hardware.* made concrete and priced. With a device (a run): resolved on it, with the process group's world
    size and its speed measured at this model's shapes. Without (a plan): a named card as its config gives it
    (datasheet figures, marked assumed in the plan), this machine resolved here with its speed measured."""
    import torch

    if device is None:
        hardware = assumed_hardware(job.hardware)
        if not plans_this_machine(job.hardware):
            return hardware
        device = torch.device("cuda", torch.cuda.current_device()) if hardware.on_cuda else torch.device("cpu")
    else:
        hardware = resolve_hardware(job.hardware, device)
        if world_size > 1:
            hardware = dataclasses.replace(hardware, world_size=world_size)
    return with_measured_speed(hardware, job, hf_config, device)


def with_measured_speed(hardware: HardwareConfig, job: JobConfig, hf_config, device: torch.device) -> HardwareConfig:
    """`hardware` (the device this process runs on) with its speed measured at this model's GEMM shapes, in each
    compute dtype the job's precision modes use (cached: core/device_speed; on CPU only the mode it takes first:
    bf16 GEMMs there take minutes to measure). The planner then prices steps with it
    instead of an assumed MFU."""
    modes = [job.precision.mode] if job.precision.mode != "auto" else auto_order(hardware.on_cuda, job.optim.name)
    if not hardware.on_cuda:  # CPU's auto takes the most exact mode that fits, untimed: its dtype is the one run
        modes = modes[:1]
    specs = [precision_spec(mode, job.optim.name) for mode in modes]
    m = ModelShape.from_hf_config(hf_config)
    # data.seq_len=auto is chosen after this (its choice is priced with this speed): measure at the context's rows
    seq_len = job.data.fixed_seq_len or context_rows(hf_config, job.parallel.cp)
    gemms, attention = speed_shapes(m, job.train.micro_batch * seq_len, seq_len, job.loss.chunk_size)
    speeds = []
    for dtype in dict.fromkeys(spec.compute_dtype for spec in specs):
        speed = measure_device_speed(device, dtype, gemms, attention, optimizer_params=m.params)
        if speed is not None:
            speeds.append(speed)
    return dataclasses.replace(hardware, speed=tuple(speeds))


def resolve_planned(
    job: JobConfig, documents: Optional[Documents] = None, pairs: Union[AttendedPairs, PairsOf, None] = None
) -> ResolvedRun:
    """`job` resolved without a run, as flexengine-plan resolves it: its model's HF config (no weights), hardware.*
    as a plan targets it (resolve_target_hardware), then `resolve`."""
    from flexengine.surgery.model import build_hf_config

    hf_config = build_hf_config(job.model)
    return resolve(job, hf_config, resolve_target_hardware(job, hf_config), documents=documents, pairs=pairs)


def resolve(
    job: JobConfig,
    hf_config,
    hardware: HardwareConfig,
    *,
    attention: Optional[AttentionSpec] = None,
    documents: Optional[Documents] = None,
    pairs: Union[AttendedPairs, PairsOf, None] = None,
) -> ResolvedRun:
    """The job resolved on concrete `hardware` (resolve_target_hardware): attn.* (None: as training resolves it
    on that device type), data.seq_len=auto over `documents` (None: the model's supported context), the fit
    (precision, memory policy, micro-batch) and parallel.*. pairs: the corpus's attended-pair count, or a function
    giving it at the resolved row length (None: each layer's mask over one whole-row document). Raises UserError
    where the chosen row length breaks an attention or RoPE rule."""
    attention = attention if attention is not None else planned_attention(job.attn, hf_config, hardware)
    planned, rows = _row_length(job, hf_config, hardware, attention, documents)
    counted = pairs(planned, attention) if callable(pairs) else pairs
    fit = plan_job(planned, hf_config, hardware, attention=attention, pairs=counted)
    resolved = resolved_job(planned, fit)
    return ResolvedRun(
        planned=planned,
        job=resolved,
        hf_config=hf_config,
        hardware=hardware,
        attention=attention,
        parallel=resolve_parallel(resolved.parallel),
        fit=fit,
        plan=fit.plan,
        precision=fit.precision,
        memory_specs=fit.plan.chosen.specs,
        micro_batch=fit.plan.chosen.micro_batch,
        grad_accum=fit.plan.chosen.grad_accum,
        seq_len=planned.data.seq_len,
        rows=rows,
        pairs=counted,
        auto_seq_len=job.data.fixed_seq_len is None,
    )


def resolved_job(job: JobConfig, fit: FitPlan) -> JobConfig:
    """The JobConfig with every auto the fit answered resolved: ResolvedRun.job, the one copy the loop reads."""
    best = fit.plan.chosen
    return dataclasses.replace(
        job,
        hardware=fit.hardware,
        memory=dataclasses.replace(best.memory),  # a copy: the job must not share the plan's candidate
        precision=PrecisionConfig(mode=fit.precision.name),
        optim=dataclasses.replace(job.optim, name=fit.precision.optimizer),
        train=dataclasses.replace(job.train, micro_batch=best.micro_batch, grad_accum=best.grad_accum),
        # parallel.mixed_precision stays the user's switch: whether FSDP casts is the spec's answer (fsdp_policy)
        parallel=dataclasses.replace(
            job.parallel,
            reduce_every=best.time.reduce_every.value,  # the gradient reduction the plan counted
        ),
    )


def _row_length(
    job: JobConfig,
    hf_config,
    hardware: HardwareConfig,
    attention: AttentionSpec,
    documents: Optional[Documents],
) -> tuple[JobConfig, Optional[RowLengthChoice]]:
    """data.seq_len=auto: the row length chosen over the documents (checked as a given one is), or the model's
    supported context without any; a number: the job as it is."""
    if job.data.fixed_seq_len is not None:
        return job, None
    if documents is None:
        return with_seq_len(job, context_rows(hf_config, job.parallel.cp)), None

    def plan_at(seq_len: int, pairs: AttendedPairs) -> FitPlan:
        return plan_job(with_seq_len(job, seq_len), hf_config, hardware, attention=attention, pairs=pairs)

    limits, cp, allow_long_context = context_limits(hf_config), job.parallel.cp, job.model.allow_long_context
    choice = choose_row_length(plan_at, documents, hardware, attention, limits, cp=cp, long_context=allow_long_context)
    job = with_seq_len(job, choice.seq_len)
    resolve_attention_rules(job.attn, job.data, job.model)  # the window and RoPE rules that needed the length
    check_checkpoint_rope(job, hf_config)
    return job, choice


def with_seq_len(job: JobConfig, seq_len: int) -> JobConfig:
    """The job with rows of `seq_len` tokens."""
    return dataclasses.replace(job, data=dataclasses.replace(job.data, seq_len=seq_len))


def with_lora_rank(job: JobConfig, r: int) -> JobConfig:
    """The job with LoRA adapters of rank `r` (0: a full fine-tune)."""
    return dataclasses.replace(job, model=dataclasses.replace(job.model, lora=dataclasses.replace(job.model.lora, r=r)))


def check_checkpoint_rope(job: JobConfig, hf_config) -> None:
    """The RoPE scaling a checkpoint carries, against context parallelism and packed documents (data.seq_len=auto:
    once the length is chosen)."""
    if job.data.fixed_seq_len is None:
        return
    limits = context_limits(hf_config)
    check_fixed_rope(
        limits.rope_type,
        f"model.path={job.model.path}, whose config.json has" if job.model.path else "model.arch's",
        cp=job.parallel.cp,
        attn_mode=job.attn.mode,
        packs=packs_documents(job.attn.mode),
        rows=(job.data.seq_len, limits.trained),
        instead="rope_parameters set to yarn, linear or llama3 there",
    )


def record_resolution(record: ConfigRecord, run: ResolvedRun) -> None:
    """What the resolution chose, with its sources, in the run's order: the hardware, the row length, the
    planner's choices."""
    record.update(dataclasses.replace(run.planned, hardware=run.hardware), AUTO_HARDWARE)
    if run.auto_seq_len:  # set after the hardware's update, which took the planned job's length too
        record.set("data.seq_len", run.seq_len, AUTO_ROW_LENGTH)
    record.update(run.job, AUTO_PLANNER)


def record_what_runs(record: ConfigRecord, run: ResolvedRun) -> None:
    """What the job leaves to the run, as it runs: attn.backend=auto's backend and model.path's architecture. After
    every record.update of a job (whose attn.backend stays auto: the spec travels as an object; its model.arch is
    the unread default the stages before compare with)."""
    if run.job.attn.backend == "auto":
        record.set("attn.backend", run.attention.backend.value, AUTO_ATTENTION_BACKEND)
    if run.job.model.path is not None:
        record.set("model.arch", architecture_of(Path(run.job.model.path)), FROM_MODEL_PATH)  # what trains
