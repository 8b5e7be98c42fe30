"""One training run from a typed JobConfig: the library-level path behind `python -m flexengine.train`."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from flexengine.core.allocator import allocator_line
from flexengine.core.config import HardwareConfig, JobConfig
from flexengine.core.config_record import AUTO_EPOCHS, FROM_CALLER, RESOLVED_CONFIG_FILE, ConfigRecord
from flexengine.core.device_speed import cache_path
from flexengine.core.distributed import DistInfo, cpu_group, init_distributed, rank_device, shutdown_distributed
from flexengine.core.errors import UserError, os_error_message
from flexengine.core.hardware import resolve_device
from flexengine.core.parallel_spec import ParallelSpec
from flexengine.core.storage import (
    CHECKPOINTS,
    check_output_dir,
    clean_stale_temp_dirs,
    hold_output_dir,
    write_json_atomic,
)
from flexengine.data.build import build_data, training_lengths
from flexengine.data.loader import HeldOut, RowLoader, data_plan_fingerprint
from flexengine.data.packing import packer
from flexengine.loop.checkpoint.rank_sync import run_on_rank0
from flexengine.loop.components import Components, TrainerSetup, build_components
from flexengine.loop.flops import work_per_useful_token
from flexengine.loop.forward import ForwardPath
from flexengine.loop.metrics import MetricsWriter
from flexengine.loop.progress import PlannedStep
from flexengine.loop.trainer import Trainer
from flexengine.planning.costs import ASSUMED, ASSUMED_MFU, MEASURED, UNKNOWN
from flexengine.planning.fit import check_fit
from flexengine.planning.report import FirstForwardMeter, activation_summary, meters_first_forward
from flexengine.planning.row_length import Documents, format_row_length
from flexengine.resolve import (
    ResolvedRun,
    check_checkpoint_rope,
    record_resolution,
    record_what_runs,
    resolve,
    resolve_target_hardware,
)
from flexengine.surgery.applied import attention_spec
from flexengine.surgery.attention import AttentionSpec, AttnBackend, apply_attention, resolve_attention_spec
from flexengine.surgery.attention.job_rules import resolve_attention_rules
from flexengine.surgery.compile import apply_compile, needs_compiled_blocks
from flexengine.surgery.context_parallel import ContextParallel, build_context_parallel
from flexengine.surgery.lora import apply_lora
from flexengine.surgery.memory import apply_memory_policy
from flexengine.surgery.memory.kinds import check_granularity
from flexengine.surgery.model import build_hf_config, check_vocab, load_model, load_tokenizer
from flexengine.surgery.parallel import apply_parallel, loads_weights
from flexengine.surgery.precision import PrecisionSpec, apply_precision
from flexengine.surgery.rope import check_context, context_limits

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

log = logging.getLogger(__name__)
SPEED_TIMEOUT_S = 1800.0  # the other ranks wait this long for rank 0 to measure (GEMMs at 7B shapes, the optimizer)


def with_epochs(job: JobConfig, batches_per_epoch: int) -> JobConfig:
    """train.epochs -> train.max_steps: optimizer steps covering that many passes over this rank's rows."""
    epochs = job.train.epochs
    if epochs is None:  # train.max_steps counts the run
        return job
    steps = max(1, math.ceil(epochs * batches_per_epoch / job.train.grad_accum))
    log.info(
        "train.epochs=%g: %d micro-batches per epoch / grad_accum %d -> max_steps=%d",
        epochs,
        batches_per_epoch,
        job.train.grad_accum,
        steps,
    )
    return dataclasses.replace(job, train=dataclasses.replace(job.train, max_steps=steps))


def _check_attention_backend(attention: AttentionSpec, dist_info: DistInfo, device: torch.device) -> None:
    """The resolved backend can train here: flex has no CPU backward, and only flex has a context-parallel path."""
    if attention.backend is AttnBackend.FLEX and device.type == "cpu":
        raise UserError(
            "attn.backend=flex cannot train on CPU (FlexAttention has no CPU backward); "
            "use attn.backend=dense (or auto)."
        )
    if dist_info.cp > 1 and attention.backend is not AttnBackend.FLEX:
        raise UserError(
            f"parallel.cp={dist_info.cp} needs FlexAttention (attn.backend=flex or auto on CUDA); "
            f"attn.backend resolved to {attention.backend.value} on {device.type}, which has no "
            "context-parallel path."
        )


def _run_hardware(job: JobConfig, device: torch.device, dist_info: DistInfo, hf_config) -> HardwareConfig:
    """hardware.* resolved on this device, with the process group's world size and the device's measured speed at
    this model's shapes: what the planner fits to and prices steps with. Under a process group rank 0 resolves and
    measures and every rank plans with its result: ranks measuring their own (noisy) speed and free memory could
    choose different row lengths, policies or micro-batches, and then hang or desynchronise."""
    measure = partial(resolve_target_hardware, job, hf_config, device, dist_info.world_size)
    with cpu_group(SPEED_TIMEOUT_S) as group:  # None in a single process: measured here
        return run_on_rank0(group, measure, "resolving hardware.* and measuring the device speed on rank 0")


def _resolve_run(
    job: JobConfig, hf_config: PretrainedConfig, attention: AttentionSpec, *, device: torch.device, dist_info: DistInfo
) -> ResolvedRun:
    """The run resolved before anything is allocated: hardware on this device, data.seq_len=auto over the training
    documents (tokenized through the cache the data stage reads), then precision, memory policy and micro-batch
    from the planner, or a UserError that says what would fit."""
    hardware = _run_hardware(job, device, dist_info, hf_config)
    documents = None
    if job.data.fixed_seq_len is None:
        tokenizer = load_tokenizer(job.model)
        lengths = training_lengths(job.data, job.train, tokenizer, dist_info, timeout_s=job.parallel.data_timeout_s)
        where = f"{len(lengths):,} training documents of {job.data.path or 'the demo corpus'}"
        documents = Documents(lengths, packer(lengths, job.data.packing, job.data.long_docs), where)
    run = resolve(job, hf_config, hardware, attention=attention, documents=documents)  # planned as it runs
    if run.rows is not None:
        log.info("%s", format_row_length(run.rows))
    check_fit(run.planned, run.fit, hf_config, attention)
    return run


def _build_checked_data(
    job: JobConfig,
    tokenizer: PreTrainedTokenizerBase,
    dist_info: DistInfo,
    hf_config: PretrainedConfig,
    *,
    device: torch.device,
    flex: bool,
) -> tuple[JobConfig, RowLoader, Optional[HeldOut], dict]:
    """build_data with its longest piece checked against the model's context; train.epochs becomes max_steps:
    (job, training loader, held-out batches or None, data report)."""
    pin = device.type == "cuda"  # pinned batches on CUDA: the trainer's non_blocking copies really are asynchronous
    loader, eval_data, data_report = build_data(
        job.data, job.train, tokenizer, dist_info, timeout_s=job.parallel.data_timeout_s, flex=flex, pin_memory=pin
    )
    longest = max(data_report["longest_piece"], data_report.get("eval", {}).get("longest_piece", 0))
    check_context(
        longest, context_limits(hf_config), job.data.seq_len, job.data.long_docs, job.model.allow_long_context
    )
    return with_epochs(job, loader.batches_per_epoch), loader, eval_data, data_report


def _load_weights(
    job: JobConfig,
    precision: PrecisionSpec,
    device: torch.device,
    dist_info: DistInfo,
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[nn.Module, bool]:
    """The HF model in the planned dtype, its vocabulary checked against the tokenizer; and whether its weights
    come from rank 0 by broadcast (apply_parallel) rather than from this rank's own read."""
    # One host copy of the checkpoint per job: ranks > 0 build the same shapes (random, on their device) and get
    # rank 0's weights by broadcast once wrapped (apply_parallel).
    from_rank0 = dist_info.world_size > 1 and job.model.loads_weights
    placeholder = from_rank0 and not loads_weights(dist_info)  # this rank reads no checkpoint (its log says so)
    model = load_model(job.model, device, precision.param_dtype, placeholder=placeholder)
    check_vocab(model, tokenizer)
    return model, from_rank0


def _apply_surgery(
    model: nn.Module, run: ResolvedRun, *, context_parallel: Optional[ContextParallel]
) -> tuple[nn.Module, dict]:
    """LoRA, attention, checkpoint/offload and compile, in that order; returns the model (peft's wrapper with
    LoRA) and the planner's activation summary (the first training forward may measure it: _components)."""
    job = run.job
    model = apply_lora(model, job.model.lora)  # before any wrapper, so peft finds the plain Linear names
    apply_precision(model, run.precision)  # LoRA: frozen base weights in bf16, adapters keep the master dtype
    # Surgery order (torchtitan's lesson): attention -> checkpoint/offload -> compile -> FSDP/DDP.
    apply_attention(model, run.attention)
    if context_parallel is not None:
        context_parallel.apply(model)  # part of the attention rewrite: the flex call gathers the row's K/V
    apply_memory_policy(model, run.memory_specs, max_pinned_bytes=run.plan.chosen.usage.offload_pinned_bound_bytes)
    memory_report = activation_summary(model, run.inputs(), job.memory)
    must_compile = needs_compiled_blocks(model)
    if job.train.compile or must_compile:
        if not job.train.compile:
            log.info("compile: train.compile=false, but %s: compiling the decoder blocks", must_compile)
        apply_compile(model, job.train.compile_backend)
    return model, memory_report


def _components(
    setup: TrainerSetup,
    forward: ForwardPath,
    tokenizer: PreTrainedTokenizerBase,
    loader: RowLoader,
    *,
    out_dir: Path,
    dist_info: DistInfo,
    eval_data: Optional[HeldOut],
) -> Components:
    """build_components with the fingerprint of the data stream a resume must match; where the meter can see the
    blocks, the first training forward's measured bytes replace the planner's in the memory report."""
    data_plan = data_plan_fingerprint(
        loader.corpus,
        loader.plan,
        data=setup.data,
        micro_batch=setup.train.micro_batch,
        world_size=dist_info.world_size,
        cp=dist_info.cp,
        seed=setup.train.seed,
    )
    components = build_components(
        setup, forward, loader, tokenizer, out_dir=out_dir, dist=dist_info, held_out=eval_data, data_plan=data_plan
    )
    if meters_first_forward(forward.model, dist_info.world_size):  # written when measured
        write = partial(_write_memory_section, components.metrics)
        FirstForwardMeter(forward.train_module, forward.model, setup.memory_report, write)
    return components


def _write_memory_section(metrics: MetricsWriter, report: dict) -> None:
    """TensorBoard's memory section from a memory report (the planner's, or the first forward's measurement)."""
    blocks = {f"activation_bytes_block_{i}": b for i, b in enumerate(report["activation_bytes_per_block"])}
    metrics.section("memory", blocks, 0)


def planned_step(run: ResolvedRun) -> PlannedStep:
    """The plan's step time as the run's clock compares its steps with it, by term."""
    t = run.plan.chosen.time
    terms = {
        "matmul": t.matmul_s,
        "attention": t.attention_s,
        "pointwise": t.pointwise_s,
        "loss": t.loss_s,
        "recompute": t.recompute_s,
        "optimizer": t.optimizer_s,
        "exposed_transfers": run.grad_accum * t.offload_exposed_s + t.reduce_exposed_s,
    }
    return PlannedStep(t.step_s, t.source, ASSUMED_MFU if t.source == ASSUMED else None, terms, t.source != UNKNOWN)


def trainer_setup(
    job: JobConfig,
    model: nn.Module,
    *,
    parallel: ParallelSpec,
    planned: Optional[PlannedStep] = None,
    data_report: Optional[dict] = None,
    memory_report: Optional[dict] = None,
) -> TrainerSetup:
    """What the loop reads of the job: its sections, LoRA's merge on save, the choices TensorBoard's HPARAMS tab
    lists; with the planner's parallel spec and step (planned None: no plan to compare the steps with)."""
    lora, attn = job.model.lora, attention_spec(model)
    merge = lora if lora.r > 0 and job.train.merge_lora_on_save else None
    return TrainerSetup(
        train=job.train,
        optim=job.optim,
        loss=job.loss,
        data=job.data,
        parallel=parallel,
        block_size=job.attn.block_size,
        peak_tflops=job.hardware.peak_tflops,
        merge_lora=merge,
        lora_base=Path(job.model.path) if merge is not None and job.model.path and job.model.loads_weights else None,
        planned=planned,
        hparams={
            "model": job.model.name,
            "attn": job.attn.mode,
            "backend": attn.backend.value if attn is not None else "hf",
            "memory": job.memory.policy,
            "precision": job.precision.mode,
            "optimizer": job.optim.name,
            "seq_len": job.data.seq_len,
            "packing": job.data.packing,
            "micro_batch": job.train.micro_batch,
            "grad_accum": job.train.grad_accum,
            "lr": job.optim.lr,
            "schedule": job.optim.schedule,
            "warmup_steps": job.optim.warmup_for(job.train.max_steps),
            "weight_decay": job.optim.weight_decay,
            "max_steps": job.train.max_steps,
            "lora_r": lora.r,  # 0 = full fine-tuning
            "eval_fraction": job.data.eval_fraction,
        },
        data_report=data_report if data_report is not None else {},
        memory_report=memory_report if memory_report is not None else {},
    )


def build_trainer(job: JobConfig, out_dir: Path, record: Optional[ConfigRecord] = None) -> Trainer:
    """build_planned_trainer's trainer."""
    return build_planned_trainer(job, out_dir, record)[0]


def build_planned_trainer(
    job: JobConfig, out_dir: Path, record: Optional[ConfigRecord] = None
) -> tuple[Trainer, ResolvedRun]:
    """Config -> tokenizer -> data -> model surgery -> Trainer (cheap checks first, weights last), and the
    ResolvedRun it was planned with. record: the composed job's values and sources, which takes each value
    resolved here (hardware, the planner's choices, train.epochs, the attention backend)."""
    record = record if record is not None else ConfigRecord(job, FROM_CALLER)
    resolve_attention_rules(job.attn, job.data, job.model)  # a hand-built job too (the CLI applied them already)
    torch.manual_seed(job.train.seed)
    check_granularity(job.memory.granularity)  # a hand-built JobConfig too (the CLI checked it at composition)
    device = resolve_device(job.hardware.device)
    hf_config = build_hf_config(job.model)  # a bad model.path fails here, before tokenizing or allocating anything
    check_checkpoint_rope(job, hf_config)
    dist_info = init_distributed(job.parallel, device)
    device = rank_device(device, dist_info)
    if device.type == "cuda":
        log.info("%s", allocator_line())  # expandable segments or not: the fragmentation the margin must absorb
    attention = resolve_attention_spec(job.attn, hf_config, device=device)  # windows from the model, per layer
    _check_attention_backend(attention, dist_info, device)
    context_parallel = build_context_parallel(dist_info, device)
    # Fit before allocating: precision, memory policy and micro-batch from the planner (or a clear error).
    run = _resolve_run(job, hf_config, attention, device=device, dist_info=dist_info)
    record_resolution(record, run)
    tokenizer = load_tokenizer(job.model)
    job, loader, eval_data, data_report = _build_checked_data(
        run.job, tokenizer, dist_info, hf_config, device=device, flex=attention.backend is AttnBackend.FLEX
    )
    if run.rows is not None:
        data_report["row_length"] = run.rows.to_json()  # every length weighed: summary.json's data section
    record.update(job, AUTO_EPOCHS)  # the data stage's train.epochs -> max_steps
    record_what_runs(record, run)  # the attention backend auto chose, model.path's architecture
    model, from_rank0 = _load_weights(job, run.precision, device, dist_info, tokenizer)
    model, activations = _apply_surgery(model, run, context_parallel=context_parallel)
    train_module = apply_parallel(  # FSDP/DDP last: it wraps whatever the surgery above left
        model,
        run.parallel,
        dist_info,
        device,
        job.loss,
        weights_from_rank0=from_rank0,
        fsdp_mesh=context_parallel.fsdp_mesh if context_parallel else None,
    )
    forward = ForwardPath.build(
        job.loss, model, device, train_module=train_module, precision=run.precision, context_parallel=context_parallel
    )
    setup = trainer_setup(
        job, model, parallel=run.parallel, planned=planned_step(run), data_report=data_report, memory_report=activations
    )
    components = _components(
        setup, forward, tokenizer, loader, out_dir=out_dir, dist_info=dist_info, eval_data=eval_data
    )
    return Trainer(setup, components), run


def run_training(job: JobConfig, out_dir: Path, record: Optional[ConfigRecord] = None) -> dict:
    """Train, checkpoint and write out_dir/summary.json; returns the summary. summary["exit_code"] is 0, or
    128 + signal when SIGTERM/SIGINT stopped the run (after its checkpoint and summary were written).
    record: where each of the job's values came from (the CLI's; None: every value is the caller's); with the
    values resolved at start-up it becomes out_dir/resolved_config.yaml, summary.json's config and config_sources
    and TensorBoard's config text."""
    try:
        # the lock first: a live run's directory is refused before anything is checked, cleaned or truncated
        # (under torchrun rank 0 holds it for the job; RANK is set before the process group exists)
        with hold_output_dir(out_dir, job.train.resume, enabled=os.environ.get("RANK", "0") == "0"):
            return _run_training(job, out_dir, record if record is not None else ConfigRecord(job, FROM_CALLER))
    except OSError as e:  # a filesystem fault anywhere (cache dir, output dir, ...): one paragraph with the path
        if e.filename is None:  # a timeout, a lost connection, too many open files: not "check the path"
            raise
        raise UserError(os_error_message(e, "the run")) from None


def _run_training(job: JobConfig, out_dir: Path, record: ConfigRecord) -> dict:
    if os.environ.get("RANK", "0") == "0":  # before the process group exists, torchrun's RANK says who checks/cleans
        # never mix two runs: checked before anything is written. Rank 0 only, like the lock: a rank > 0 without
        # train.output_dir has the output root as its Hydra dir (cli/train.worker_overrides), not rank 0's fresh one
        check_output_dir(out_dir, job.train.resume)
        # first: a dead save's leftovers may be what fills the disk; resume=auto owns the directory (a requeue on
        # another node removes the saves its previous node left unfinished)
        clean_stale_temp_dirs(out_dir / CHECKPOINTS, owned=job.train.resume == "auto")
    trainer, run = build_planned_trainer(job, out_dir, record)
    with trainer.stop_on_signals():  # from here a signal ends in a checkpoint and a summary, not a traceback
        trainer.checkpointer.resume()  # train.resume: auto or a step_<N> dir (none: a fresh run)
        if trainer.dist.is_main:  # after the resume's checks: a refused resume leaves the run's record as it was
            _write_record(record, out_dir, trainer)
        summary = trainer.train()
        summary["data"] = trainer.data_report
        summary.update(trainer.memory_report)  # activation_bytes, activation_bytes_per_block, memory_policy
        # what the plan allowed, beside what the allocator reserved (max_memory_reserved_bytes on CUDA)
        plan = run.plan
        summary.update(
            planned_peak_bytes=plan.chosen.usage.terms.total_bytes,
            plan_budget_bytes=plan.chosen.usage.budget.usable_bytes,
        )
        slots = trainer.setup.train.micro_batch * trainer.setup.data.seq_len
        summary["work_per_useful_token"] = work_per_useful_token(trainer.flops, summary, slots)  # vs 6N + pairs
        summary.update(config=record.as_config(), config_sources=record.sources)
        if trainer.dist.is_main:
            write_json_atomic(out_dir / "summary.json", summary)
    shutdown_distributed()
    log.info("%s", done_line(summary, out_dir / "summary.json"))
    return summary


def done_line(summary: dict, summary_path: Path) -> str:
    """The run's last log line: steps, loss, speed, time, where the summary is. A launch that resumed a finished
    run (or one stopped early) ran no step: it says so, and the numbers are the run's so far."""
    rate = summary["useful_tokens_per_s"]
    speed = "no training time recorded" if rate is None else f"{rate:.0f} useful tokens/s"
    head = "done:"
    if summary["steps_run"] == 0 and summary["steps"] > 0:
        head = f"done: no step run by this launch (it resumed at step {summary['steps']}); the run so far:"
    return (
        f"{head} {summary['steps']} steps, loss {_fmt_loss(summary['initial_loss'])} -> "
        f"{_fmt_loss(summary['final_loss'])}, {speed}, {summary['wall_s']:.1f} s ({summary['train_s']:.1f} s "
        f"training, {summary['eval_s']:.1f} s evaluating){_step_vs_plan(summary.get('step_time'))}; summary: "
        f"{summary_path}"
        + (f"; stopped by a signal, exit status {summary['exit_code']}" if summary["exit_code"] else "")
    )


def _step_vs_plan(report: Optional[dict]) -> str:
    """', step 1.9 s measured vs 1.7 s planned (1.12x; planned from measured device speed)' for the done line."""
    if not report or report["measured_s"] is None or report["planned_s"] is None:
        return ""
    if report["planned_source"] == UNKNOWN:  # the planner's figure only ranked policies: nothing to compare
        return f", step {report['measured_s']:.2f} s measured (no planned time: {UNKNOWN})"
    ratio = f"{report['ratio']:.2f}x" if report["ratio"] is not None else "n/a"
    return (
        f", step {report['measured_s']:.2f} s measured vs {report['planned_s']:.2f} s planned ({ratio}; planned from "
        f"{report['planned_source']}; median after the first {report['excluded_first_steps']} step(s))"
        + _stale_speed_hint(report)
    )


def _stale_speed_hint(report: dict) -> str:
    """A step beyond 2x of a plan priced with the cached device speed: the speed is measured once per device and
    kept, so one measured while other jobs loaded a shared machine misprices every later run (seen: 0.09x)."""
    if report["planned_source"] != MEASURED or report["ratio"] is None or 0.5 <= report["ratio"] <= 2:
        return ""
    return (
        f"; far from its plan: if the device speed cached in {cache_path()} was measured under another load than "
        "now, delete that file to measure it again"
    )


def _write_record(record: ConfigRecord, out_dir: Path, trainer: Trainer) -> None:
    """The configuration as it runs: out_dir/resolved_config.yaml (each value's source as a comment) and
    TensorBoard's config text and start-up reports, written once the resume (if any) has been verified and before
    step 1 (a run that fails or is stopped later still says what it ran)."""
    path = record.write(out_dir / RESOLVED_CONFIG_FILE)
    changed = sorted(k for k, kind in record.kinds().items() if kind in ("first-contact", "auto"))
    log.info("config as it runs (each value's source beside it): %s; set at start-up: %s", path, ", ".join(changed))
    metrics = trainer.metrics
    metrics.text("config/resolved", "    " + record.to_yaml().replace("\n", "\n    "), 0)  # code block
    metrics.section("packing", trainer.data_report, 0)  # the per-step tags live under data/
    if not meters_first_forward(trainer.model, trainer.dist.world_size):  # else at the first forward
        _write_memory_section(metrics, trainer.memory_report)


def _fmt_loss(loss: Optional[float]) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"  # a real 0.0 stays 0.0000
