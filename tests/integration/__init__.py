"""End-to-end tests: each builds a run, trains through the entry point or starts a process (the integration tier:
`pytest -m integration`). The tree mirrors the package as tests/ does."""
