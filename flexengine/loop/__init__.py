"""The trainer (step + loop) and the components it calls: checkpointer, evaluator, loss, optim, metrics."""
