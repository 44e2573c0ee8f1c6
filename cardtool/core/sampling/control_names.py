"""The control preprocessors' names (control.py implements them), importable without numpy for card checks."""

PREPROCESSORS = ("silhouette", "edges", "none")
