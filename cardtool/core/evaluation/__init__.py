"""Evaluation: `eval` of a card, the judge that serves as reward and feature extractor, the metrics, and the
parity of a card's components and loop against the numpy forwards (`parity_report`: the `parity` command's call)."""
