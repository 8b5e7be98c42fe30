"""`flexengine-stats` / `python -m flexengine.stats`: document lengths, packing strategies and context coverage
of the configured data, before any training (the numbers come from flexengine/data/stats.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from flexengine.core.extras import install_command, installed
from flexengine.data.stats import (
    compare_strategies,
    context_summary,
    format_context,
    format_report,
    length_summary,
    plot_length_histogram,
)


def write_histogram(lengths: np.ndarray, seq_len: int, png: Path) -> str:
    """Draw the document-length histogram at `png` (matplotlib: the `plots` extra), or say why it is not drawn;
    the end of the line that reports what was written."""
    if not installed("matplotlib"):  # the numbers are in the table and the JSON: the picture is not worth a stop
        return f"(no {png.name}: the histogram needs matplotlib, {install_command('matplotlib')})"
    plot_length_histogram(lengths, seq_len, png)
    return f"and {png}"


def main() -> None:
    """Hydra entry point (same conf/ and overrides as flexengine.train)."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from flexengine.cli.common import CONFIG_PATH, fail, register_schema, run_hydra_app, to_job_config
    from flexengine.core.errors import UserError
    from flexengine.core.storage import write_json_atomic

    @hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
    def _stats(cfg: DictConfig) -> None:
        from flexengine.data.mix import build_sources, mix_documents
        from flexengine.surgery.model import build_hf_config, load_tokenizer
        from flexengine.surgery.rope import context_limits

        try:
            job = to_job_config(cfg)
            limits = context_limits(build_hf_config(job.model))
            corpus, source_of = build_sources(job.data, load_tokenizer(job.model))
            lengths, mix_report = corpus.lengths, None
            if source_of is not None:  # the documents the mixture trains on, repeats included
                docs, mix_report = mix_documents(
                    lengths, source_of, np.arange(len(corpus)), job.data.mix, job.train.seed
                )
                lengths = lengths[docs]
        except UserError as e:
            fail(e)
        d = job.data
        summary = length_summary(lengths)
        strategies = compare_strategies(lengths, d.seq_len, d.long_docs, job.train.micro_batch, job.train.seed)
        context = context_summary(lengths, limits.trained, limits.supported)
        print(format_report(summary, strategies, d.seq_len, job.train.micro_batch))
        print(format_context(summary, context, limits.describe()))
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        report = {
            "seq_len": d.seq_len,
            "long_docs": d.long_docs,
            "micro_batch": job.train.micro_batch,
            "skipped": corpus.skipped,
            "lengths": summary,
            "strategies": strategies,
            "context": context,
            "mix": mix_report,
        }
        write_json_atomic(out_dir / "data_stats.json", report)
        drawn = write_histogram(lengths, d.seq_len, out_dir / "data_stats.png")
        print(f"\nwrote {out_dir / 'data_stats.json'} {drawn}")

    register_schema()
    # a multirun of stats jobs is not a training sweep: no training summary (flexengine.sweep) for it
    if not any(a.startswith(("~hydra.callbacks", "hydra.callbacks")) for a in sys.argv[1:]):
        sys.argv.append("~hydra.callbacks.sweep_summary")
    run_hydra_app(_stats)


if __name__ == "__main__":
    main()
