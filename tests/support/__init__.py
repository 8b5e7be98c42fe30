"""Programs the tests start (under torchrun or alone) and the precision proof they share with the GPU check;
not tests themselves (pytest collects only test_*.py)."""
