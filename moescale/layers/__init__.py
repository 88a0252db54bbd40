"""Single-device MoE math: the block, expert containers, kernels and the reference oracle.

Nothing here imports torch.distributed or creates streams.
"""
