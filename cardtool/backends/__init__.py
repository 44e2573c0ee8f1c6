"""The platform: registries, detection, kernels and reference implementations."""
