"""How long the seed workload takes, as flexengine-plan estimates it: 20,000 documents of ~6,000 tokens, one epoch,
DeepSeek-7B (experiment=deepseek7b_6k_a100) on one A100-80G and on eight, full fine-tune and LoRA r=16, at the row
length the experiment's data.seq_len=auto chooses (every length it weighed listed: 6,144, one document fills a row)
and at 8,192 (one document per row too, 27 % of the slots padding).

Estimates, not measurements: the step time is the planner's (its FLOPs at 40 % MFU plus the transfers backward
cannot hide). The same numbers as `python -m flexengine.plan experiment=deepseek7b_6k_a100 plan.documents=20000
plan.doc_tokens=6000 plan.epochs=1`.

    .venv/bin/python bench/corpus_time.py      # writes bench/results/corpus_time.{json,md}
"""

from __future__ import annotations

import json
from pathlib import Path

from flexengine.cli.common import compose_job
from flexengine.cli.plan import PlanOptions, plan_report
from flexengine.planning.corpus_time import Corpus, format_corpus_hours
from flexengine.planning.row_length import format_row_length, mfu_ladder

RESULTS = Path(__file__).resolve().parent / "results"
SEED = PlanOptions(documents=20_000, doc_tokens=6_000, epochs=1)
ROWS = {"data.seq_len=auto (the experiment)": [], "8192": ["data.seq_len=8192"]}


def main() -> None:
    """Plan the seed corpus at both row lengths; print and save the tables."""
    report, sections = [], []
    for name, extra in ROWS.items():
        job = compose_job(["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", *extra])
        # the plan command's path: auto weighs the seed's documents; the packed rows' attended pairs too
        plan, hours, choice = plan_report(job, SEED)
        assert hours is not None and plan.work is not None
        corpus, rows = Corpus(**hours["corpus"]), hours["alternatives"]
        pairs = plan.fit.plan.attention_pairs.as_dict()["fraction_of_row_squared"]
        entry = {"seq_len": plan.fit.plan.seq_len, "corpus": corpus.describe, "attended_fraction": pairs}
        entry.update(alternatives=rows, work_per_useful_token=plan.work.to_json())
        weighed = ""
        if choice is not None:
            entry["row_length"] = choice.to_json()
            weighed = f"{format_row_length(choice)}\n{mfu_ladder(choice.chosen)}\n\n"
        report.append(entry)
        table = format_corpus_hours(rows, corpus, job.hardware.name)
        sections.append(f"### rows of {name}\n\n```\n{weighed}{table}\n{plan.work.describe()}\n```")
    intro = (
        "`python bench/corpus_time.py` (= `python -m flexengine.plan experiment=deepseek7b_6k_a100 "
        "plan.documents=20000 plan.doc_tokens=6000 plan.epochs=1`). Step times are the planner's (FLOPs at "
        "40 % MFU plus exposed transfers), not measured; no GPU run of this workload is recorded yet. The attention "
        "core counts the pairs each packed row's mask allows (its document's and its padding's, each causal), not "
        "the whole row's causal half. The 8-GPU and LoRA rows keep the experiment's 8 rows per optimizer step."
        " data.seq_len=auto weighs full fine-tuning on one card (the job as configured)."
    )
    title = "## How long: 20,000 documents of ~6,000 tokens, one epoch, DeepSeek-7B (estimates)"
    text = "\n\n".join([title, intro, *sections])
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "corpus_time.json").write_text(json.dumps(report, indent=1))
    (RESULTS / "corpus_time.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
