"""Hydra configuration groups (model, attn, memory, loss, data, optim, hardware, debug, experiment)."""
