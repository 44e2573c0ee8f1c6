"""cardtool: a diffusion model's recipe and runtime as one versioned card, and the tool that runs it."""

__version__ = "0.1.0"
