"""Training: configuration, data, the loop, checkpoints, metrics, report and the `train` CLI."""
