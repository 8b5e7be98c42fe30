"""Costs read from resolved specs, the memory/time search, fit, max sequence length."""
