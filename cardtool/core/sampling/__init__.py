"""Sampling: a loaded card (ModelInstance), the one denoise loop and its step-level batcher, the text-feature
cache, and `generate` with its PNG output."""
