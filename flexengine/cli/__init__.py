"""Entry points: Hydra in, typed JobConfig out (train, plan, doctor, stats, sweep, copy)."""
