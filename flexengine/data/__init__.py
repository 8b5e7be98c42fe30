"""Data: read records -> tokenize once -> cache -> pack -> batches (sources, encode, cache, corpus, packing, loader),
plus targets.py (IGNORE_INDEX, which positions carry a target), stats, mix and the offline demo corpus. It knows no
loop, surgery or plan (docs/architecture.md)."""
