"""`python -m flexengine.plan model=deepseek7b data.seq_len=6144 hardware=a100_80g [plan.format=json]`
`python -m flexengine.plan model=deepseek7b hardware=a100_80g plan.max_seq_len=true [plan.png=maxlen.png]`

Composes the same conf/ as training (plus a `plan` node: format=table|json) and prints the memory plan of one
step: weights, grads, optimizer states, activations per block for every policy, logits, workspace, total vs the
card's budget, and the policy `memory=auto` would choose; and the model's trained context against data.seq_len
(with data.path and the model's tokenizer, against the documents' length percentiles). Reads only the model's HF
config: no weights.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import hydra
from omegaconf import DictConfig

from flexengine.cli.common import CONFIG_PATH, fail, register_schema, run_hydra_app, to_job_config, to_job_record
from flexengine.cli.first_contact import format_params
from flexengine.cli.plan_max_seq_len import DEFAULT_PNG, build_max_seq_len, format_max_seq_len, gib, max_seq_len_png
from flexengine.core.config import SEQ_LEN_AUTO, HardwareConfig, JobConfig, check_context_parallel
from flexengine.core.config_record import ConfigRecord
from flexengine.core.errors import UserError

if TYPE_CHECKING:  # the planner imports torch: loaded inside the commands that plan
    from flexengine.planning.corpus_time import Corpus
    from flexengine.planning.fit import FitPlan
    from flexengine.planning.row_length import Documents, RowLengthChoice
    from flexengine.planning.shapes import AttendedPairs
    from flexengine.planning.work import WorkPerToken
    from flexengine.resolve import ResolvedRun
    from flexengine.surgery.attention.spec import AttentionSpec


@dataclass
class PlanOptions:
    """Options of the planner CLI."""

    format: str = "table"  # table | json | resolved (the config a run of these overrides would record, each value
    # with its source: resolved_config.yaml without training)
    max_seq_len: bool = False  # instead: the longest data.seq_len that fits per policy, its step time, and a PNG
    png: Optional[str] = DEFAULT_PNG  # where plan.max_seq_len=true draws memory vs seq_len per policy; null: none
    cp: Optional[int] = None  # context-parallel degree to plan for (hardware.world_size ranks, cp of them share
    # each row); None = the job's parallel.cp
    candidates: bool = False  # plan.format=json: also every candidate the search weighed (~380 KB at 7B)
    # "how long will my corpus take" (flexengine/cli/plan_corpus.py): any of these adds the hours of the corpus for
    # the plan and its alternatives (full fine-tune vs LoRA, 1 vs 8 GPUs)
    epochs: Optional[float] = None  # passes over the corpus (None: train.epochs, else 1)
    tokens: Optional[float] = None  # the corpus's token count, e.g. 120e6 (in full rows: no padding counted)
    documents: Optional[int] = None  # the corpus's document count, with doc_tokens: packed as training packs
    doc_tokens: Optional[int] = None  # tokens per document (plan.documents=20000 plan.doc_tokens=6000)


@dataclass
class PlanJobConfig(JobConfig):
    """JobConfig plus the planner's own options (registered only when this CLI runs)."""

    plan: PlanOptions = field(default_factory=PlanOptions)


@dataclass(frozen=True)
class PlanReport:
    """What flexengine-plan reports: the fit (and the plan behind it) and what the command adds around it."""

    fit: FitPlan
    params: int  # the model's parameter count
    hardware: HardwareConfig  # concrete: what the plan assumed
    updates_arrive_at_lr: bool  # whether AdamW updates of size optim.lr reach the stored weights
    context: dict[str, Any]  # context_report: the model's trained/supported context against data.seq_len
    cp: int  # ranks sharing each row
    work: WorkPerToken  # executed FLOPs per useful token against the model's own count
    node_of_8: Optional[FitPlan] = None  # the same job on a node of 8 such GPUs (a GPU and fewer than 8 ranks)


def format_table(report: PlanReport) -> str:
    """The plan as a human-readable table: the fit (precisions tried, k -> memory / recompute), every term of
    the chosen step, the assumptions, the context, and what a node of 8 changes."""
    from flexengine.planning.costs import assumed_and_measured
    from flexengine.planning.fit import format_fit

    plan = report.fit.plan
    model = f"{plan.hf_config.get('model_type')} ({format_params(report.params)} parameters)"
    lines = [
        f"model: {model}  seq_len={plan.seq_len}",
        format_fit(report.fit),
        "",
        "  every term of the chosen policy's step:",
    ]
    usage = plan.chosen.usage
    lines += [f"    {k.removesuffix('_bytes'):<28} {gib(v)}" for k, v in usage.terms.items()]
    lines.append(f"    {'= planned peak':<28} {gib(usage.terms.total_bytes)} of {usage.budget.describe()}")
    lines += assumed_and_measured(plan.assumptions, plan.chosen.time.source, plan.dtype, report.hardware)
    if not usage.fits:
        lines.append("NOTHING FITS. What would: " + "; ".join(plan.suggestions))
    ctx = report.context
    lines.append(
        f"context: model {ctx['describe']}; rows of {plan.seq_len} tokens "
        + (
            "fit it"
            if ctx["rows_within_supported"]
            else f"can hold documents past it (training stops unless every document is <= {ctx['supported_context']}"
            " tokens; see model.rope_scaling)"
        )
    )
    if "documents" in ctx:
        d = ctx["documents"]
        lines.append(
            f"  documents: p50={d['p50']} p90={d['p90']} p99={d['p99']} max={d['p100']}; "
            f"{100 * d['documents_within_trained']:.1f}% within {ctx['trained_context']} positions, "
            f"{d['documents_over_supported']} longer than {ctx['supported_context']}"
        )
    lines.append(report.work.describe())
    if report.node_of_8 is not None:
        node = report.node_of_8.plan.chosen
        lines.append(
            "on 8 such GPUs (FSDP shards weights, grads and optimizer states): "
            f"total {gib(node.usage.terms.total_bytes)} per GPU of {gib(node.usage.budget.usable_bytes)} budget, "
            f"precision {report.node_of_8.precision.name}, "
            f"policy {node.label}, recompute {100 * node.time.recompute_flops_fraction:.1f}%"
            + ("" if node.usage.fits else " (still does not fit)")
        )
    return "\n".join(lines)


def context_report(job: JobConfig, hf_config) -> dict:
    """Trained and supported context vs data.seq_len; with data.path and the model's own tokenizer, also where
    the documents' lengths fall (tokenized through the same cache as training)."""
    from flexengine.surgery.rope import context_limits

    limits = context_limits(hf_config)
    report = {
        "trained_context": limits.trained,
        "supported_context": limits.supported,
        "describe": limits.describe(),
        "rows_within_supported": job.data.seq_len <= limits.supported,
    }
    if job.data.source != "demo" and (job.model.path or job.model.tokenizer):
        from flexengine.data.corpus import build_corpus
        from flexengine.data.stats import context_summary, length_summary
        from flexengine.surgery.model import load_tokenizer

        lengths = build_corpus(job.data, load_tokenizer(job.model)).lengths
        report["documents"] = {**length_summary(lengths), **context_summary(lengths, limits.trained, limits.supported)}
    return report


def build_plan(run: ResolvedRun, rows: Optional[list[list[int]]] = None) -> PlanReport:
    """The plan of a resolved job (architecture only; named hardware is not probed), its work per useful token (rows:
    as plan_work takes them), and on a GPU with fewer than 8 ranks the same job on a node of 8."""
    from flexengine.planning.shapes import ModelShape
    from flexengine.resolve import resolve

    job, hardware, node = run.planned, run.hardware, None
    if not hardware.on_cpu and hardware.world_size < 8:  # what a full node changes
        eight = dataclasses.replace(hardware, world_size=8)
        node = resolve(job, run.hf_config, eight, attention=run.attention, pairs=run.pairs).fit
    return PlanReport(
        fit=run.fit,
        params=ModelShape.from_hf_config(run.hf_config).params,
        hardware=hardware,
        updates_arrive_at_lr=run.precision.updates_arrive(job.optim.lr),
        context=context_report(job, run.hf_config),
        cp=job.parallel.cp,
        work=plan_work(run, rows),
        node_of_8=node,
    )


# The HF config fields the plan reads (the model's shape and parameter count, its context and attention windows):
# plan.format=json carries these, not the whole config (id2label, torch_dtype, token ids, ...)
PLAN_HF_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "attention_bias",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rope_parameters",
    "rope_scaling",
    "sliding_window",
    "layer_types",
)


def plan_summary(report: PlanReport) -> dict[str, Any]:
    """The plan's answer in a few fields a script reads first: the chosen precision, memory policy and batch shape,
    the peak against the budget (and what the budget is made of), the estimated step time and tokens per second."""
    from flexengine.planning.fit import format_fit_summary
    from flexengine.planning.plan import budget_json

    fit, plan, hardware = report.fit, report.fit.plan, report.hardware
    best = fit.plan.chosen
    usage, step_s = best.usage, best.time.step_s
    tokens = plan.seq_len * best.micro_batch * best.grad_accum * hardware.world_size // report.cp
    return {
        "fits": usage.fits,
        "precision": fit.precision.name,
        "policy": best.label,
        "memory": dataclasses.asdict(best.memory),
        "micro_batch": best.micro_batch,
        "grad_accum": best.grad_accum,
        "seq_len": plan.seq_len,
        "hardware": hardware.name,
        "world_size": hardware.world_size,
        "params": report.params,
        "total_bytes": usage.terms.total_bytes,
        **budget_json(usage.budget),
        "host_bytes": usage.host_bytes,
        "host_budget_bytes": usage.host_budget_bytes,
        "step_s": step_s,  # an estimate: the planner's FLOPs at its assumed MFU plus exposed transfers
        "tokens_per_step": tokens,  # row tokens of one optimizer step over all ranks (padding included)
        "tokens_per_s": tokens / step_s if step_s else None,
        "describe": format_fit_summary(fit).split("; runners-up")[0],
    }


def plan_json(report: PlanReport, candidates: bool = False) -> dict[str, Any]:
    """plan.format=json: `summary` first, then the plan's fields with the HF config reduced to PLAN_HF_KEYS, then
    the command's own; the candidate table (every policy x k x micro-batch weighed) only with candidates=True."""
    plan, summary = report.fit.plan, plan_summary(report)
    if not candidates:
        summary["candidates"] = f"{len(plan.candidates)} weighed; plan.candidates=true lists them"
    body = {k: v for k, v in plan.to_json().items() if candidates or k != "candidates"}
    body["hf_config"] = {k: plan.hf_config[k] for k in PLAN_HF_KEYS if plan.hf_config.get(k) is not None}
    out = {
        "summary": summary,
        **body,
        "params": report.params,
        "hardware": dataclasses.asdict(report.hardware),
        "precision_table": [t.to_json() for t in report.fit.precision_table],
        "updates_arrive_at_lr": report.updates_arrive_at_lr,
        "context": report.context,
        "cp": report.cp,
    }
    if report.node_of_8 is not None:
        node = report.node_of_8.plan.chosen
        out["node_of_8"] = {
            "precision": report.node_of_8.precision.name,
            "total_bytes": node.usage.terms.total_bytes,
            "budget_bytes": node.usage.budget.usable_bytes,
            "fits": node.usage.fits,
            "policy": node.label,
            "recompute_flops_fraction": node.time.recompute_flops_fraction,
        }
    out["work_per_useful_token"] = report.work.to_json()
    return out


class CorpusPairs:
    """The corpus of plan.epochs / plan.tokens / plan.documents in packed rows at the resolved row length, and the
    attended pairs their masks allow (resolve's `pairs`); what it counted stays for the hours and the work."""

    def __init__(self, options: PlanOptions) -> None:
        self.options = options
        self.corpus: Optional[Corpus] = None
        self.rows: Optional[list[list[int]]] = None  # each packed row's document pieces (None: lengths unknown)

    def __call__(self, job: JobConfig, attention: AttentionSpec) -> Optional[AttendedPairs]:
        from flexengine.cli.plan_corpus import corpus_rows
        from flexengine.planning.specs import packed_pairs

        self.corpus, self.rows = corpus_rows(job, self.options)
        if not self.rows:
            return None
        source = f"the mask of the packed rows of {self.corpus.describe}"
        return packed_pairs(attention, self.rows, job.data.seq_len, source)


def plan_report(
    job: JobConfig, options: PlanOptions, has_documents: bool = True
) -> tuple[PlanReport, Optional[dict], Optional[RowLengthChoice]]:
    """The plan of `job` resolved on its hardware (flexengine.resolve), the work per useful token; with plan.epochs /
    plan.tokens / plan.documents the corpus in packed rows and its hours for the plan and the alternatives
    (flexengine.cli.plan_corpus) as {"corpus": ..., "alternatives": [...]}, whose rows also give the attended
    pairs their masks allow (else each layer's mask over one whole-row document); and data.seq_len=auto's choice."""
    from flexengine.cli.plan_corpus import corpus_hours, wants_corpus_time
    from flexengine.resolve import resolve_planned

    corpus = CorpusPairs(options) if wants_corpus_time(options) else None
    run = resolve_planned(job, plan_documents(job, options, has_documents), pairs=corpus)
    report = build_plan(run, corpus.rows if corpus else None)
    if corpus is None or corpus.corpus is None:
        return report, None, run.rows
    hours = corpus_hours(
        run.planned, run.hf_config, run.hardware, corpus.corpus, attention=run.attention, pairs=run.pairs
    )
    return report, {"corpus": dataclasses.asdict(corpus.corpus), "alternatives": hours}, run.rows


def plan_work(run: ResolvedRun, rows: Optional[list[list[int]]] = None) -> WorkPerToken:
    """The plan's executed FLOPs per useful token (flexengine.planning.work) at its precision, micro-batch and
    policy; rows: the packed rows' document pieces (None: rows of one whole-row document, no padding)."""
    from flexengine.planning.shapes import ModelShape
    from flexengine.planning.work import document_pair_fractions, work_per_token

    x, fit = run.inputs(), run.fit  # the fit's micro-batch and accumulation
    m, seq_len = ModelShape.from_hf_config(run.hf_config), run.seq_len
    if not rows:  # whole rows of one document: the documents' pairs are the row's, as the plan counted them
        fractions = x.pairs.of_rank(1)
        whole = list(fractions) if isinstance(fractions, tuple) else [fractions] * m.layers
        return work_per_token(m, x, fit.plan.chosen.specs, 1.0, whole)
    useful = sum(map(sum, rows)) / (len(rows) * seq_len)
    documents = document_pair_fractions(run.attention, rows, seq_len)
    return work_per_token(m, x, fit.plan.chosen.specs, useful, documents)


def plan_documents(job: JobConfig, options: PlanOptions, has_documents: bool = True) -> Optional[Documents]:
    """data.seq_len=auto: the documents its row length is chosen over, plan.documents x plan.doc_tokens or the
    job's own (None: the model's supported context, where the job names no data and plan.documents is unset, or
    plan.tokens is given without documents). has_documents: False when the command planned the demo corpus in
    place of the job's. Priced on this machine at its measured speed as the run prices it (flexengine/run.py), so
    both choose the same length."""
    from flexengine.cli.plan_corpus import document_lengths
    from flexengine.data.packing import packer
    from flexengine.planning.row_length import Documents

    if job.data.fixed_seq_len is not None:
        return None
    if options.documents is None and (options.tokens is not None or not has_documents):
        return None
    lengths, describe = document_lengths(job, options, "data.seq_len=auto")
    epochs = options.epochs if options.epochs is not None else (job.train.epochs or 1.0)
    return Documents(lengths, packer(lengths, job.data.packing, job.data.long_docs), describe, epochs)


def plan_job_config(cfg: DictConfig) -> JobConfig:
    """The job to plan, at plan.cp (default parallel.cp). plan.max_seq_len searches row lengths of its own
    (multiples of cp x 128), so there data.seq_len, which it never uses, need not split into cp x 128 blocks."""
    cp = cfg.plan.cp if cfg.plan.cp is not None else cfg.parallel.cp
    if cfg.plan.max_seq_len:
        cfg.parallel.cp = 1  # composed without context parallelism's row-length rule; its other rules: below
    job = to_job_config(cfg)
    if cp < 1 or job.hardware.world_size % cp:
        raise UserError(
            f"plan.cp / parallel.cp={cp} must divide hardware.world_size={job.hardware.world_size} "
            "(each row is shared by cp ranks), e.g. hardware.world_size=8 parallel.cp=8"
        )
    parallel = dataclasses.replace(job.parallel, cp=cp)
    if not cfg.plan.max_seq_len:
        return dataclasses.replace(job, parallel=parallel)  # JobConfig checks data.seq_len against cp again
    if cp > 1:
        check_context_parallel(cp, job.attn, None, job.model.rope_scaling.rope_type)
    job.parallel = parallel
    return job


PLAN_ONLY = "auto: flexengine-plan reads the architecture only (a training run needs model.path / data.path)"


def resolved_record(cfg: DictConfig, plan_only: dict) -> ConfigRecord:
    """plan.format=resolved: the record a training run of these overrides would write (resolved_config.yaml),
    without training: composition, first-contact, the hardware (named, or this machine), the planner's choices and
    the attention backend on that device, in the run's order (flexengine/run.py: build_trainer). train.epochs stays
    as given (its step count needs the tokenized data). plan_only: the keys this command set itself, and to what."""
    from flexengine.resolve import record_resolution, record_what_runs, resolve_planned

    job, record = to_job_record(cfg)
    record.drop("plan")  # this command's own options
    for key, value in plan_only.items():
        record.set(key, value, PLAN_ONLY)
    run = resolve_planned(job, plan_documents(job, cfg.plan, has_documents="data.source" not in plan_only))
    record_resolution(record, run)
    record_what_runs(record, run)
    return record


FORMATS = ("table", "json", "resolved")


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra task: compose -> JobConfig -> plan -> print."""
    from flexengine.planning.corpus_time import Corpus, format_corpus_hours
    from flexengine.planning.row_length import CONTEXT_ROWS, format_row_length, mfu_ladder

    plan_only = {}
    if cfg.model.path is None:
        plan_only["model.init"] = cfg.model.init = "random"  # the planner reads only the architecture
    if cfg.data.source != "demo" and not cfg.data.path:
        plan_only["data.source"] = cfg.data.source = "demo"  # no documents: only data.seq_len matters
    fmt = cfg.plan.format
    try:
        if fmt not in FORMATS:
            raise UserError(f"plan.format={fmt!r}: choose one of {', '.join(FORMATS)}")
        if fmt == "resolved":
            print(resolved_record(cfg, plan_only).to_yaml(), end="")
            return
        job = plan_job_config(cfg)
        if cfg.plan.max_seq_len:
            report = build_max_seq_len(job, max_seq_len_png(cfg.plan.png))
            print(json.dumps(report, indent=1) if fmt == "json" else format_max_seq_len(report))
            return
        plan, hours, rows = plan_report(job, cfg.plan, has_documents="data.source" not in plan_only)
    except UserError as e:
        fail(e)
    if fmt == "json":
        extra = {"corpus_time": hours} if hours else {}
        if rows is not None:
            extra["row_length"] = rows.to_json()
        print(json.dumps({**plan_json(plan, cfg.plan.candidates), **extra}, indent=1))
    else:
        if rows is not None:
            print(format_row_length(rows) + "\n" + mfu_ladder(rows.chosen) + "\n")
        elif cfg.data.seq_len == SEQ_LEN_AUTO:
            print(f"rows: data.seq_len=auto without documents: {CONTEXT_ROWS} ({plan.fit.plan.seq_len:,} tokens)\n")
        print(format_table(plan))
        if hours:
            print("\n" + format_corpus_hours(hours["alternatives"], Corpus(**hours["corpus"]), job.hardware.name))


def cli() -> None:
    """Register the planner schema (only here, so training never sees a `plan` key) and run."""
    register_schema(PlanJobConfig)
    # No run directory or log files for a read-only report; stdout stays pure JSON with plan.format=json.
    defaults = [
        "hydra.output_subdir=null",
        "hydra.run.dir=.",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]
    given = {a.split("=")[0] for a in sys.argv[1:]}
    sys.argv += [d for d in defaults if d.split("=")[0] not in given]
    run_hydra_app(main, PlanJobConfig)


if __name__ == "__main__":
    cli()
