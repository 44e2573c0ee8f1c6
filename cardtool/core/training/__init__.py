"""Training: the shared trainer, recipes with overrides, `train` (the command's domain function) and
`methods/`, one Task per method."""
