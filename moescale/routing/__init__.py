"""Routers (top-k, noisy top-k, Switch, GShard), their configuration, capacity and aux losses.

Nothing here imports torch.distributed.
"""
