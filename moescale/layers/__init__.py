"""Single-device MoE math: the block, the containers (stacked, module, and the
expert-parallel shard) that speak the expert interface (moescale.dispatch.protocol), expert
state access, kernels and the reference oracle.

Nothing here imports torch.distributed or creates streams.
"""
