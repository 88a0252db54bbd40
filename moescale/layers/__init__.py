"""Single-device MoE math: the block, the expert interface every container speaks
(protocol.py), the containers (stacked, module, and the expert-parallel shard), kernels and the
reference oracle.

Nothing here imports torch.distributed or creates streams.
"""
