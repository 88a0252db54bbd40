"""torch.distributed for MoE: process groups, the autograd all-to-all, static expert parallelism,
the pipelined all-to-all, gradient synchronization, and a local multi-process launcher.

Importing this package imports torch.distributed; `moescale.layers` and `moescale.routing`
never do.
"""
