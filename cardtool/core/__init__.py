"""Device-free domain logic, grouped by idea: `cards` (the manifest and everything that reads or writes it),
`sampling` (the denoise loop and generate), `training` (the trainer, recipes, methods), `evaluation` (eval,
judges, metrics, card parity); `data` and `prompts` are the dataset and its prompts, shared by all four."""
