"""Programs the tests start (under torchrun or alone) and the libraries they share with bench/ (the precision proof
the GPU check runs, the long-horizon optimizer numerics); not tests themselves (pytest collects only test_*.py)."""
