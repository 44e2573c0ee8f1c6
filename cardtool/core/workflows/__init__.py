"""Workflows: the flywheel and workflow manifests (chain, parallel, best-of-N)."""
