"""The card itself: the manifest schema, reading and locating manifests, loading and validation (deep
included), discovery, lineage, weight files, and writing new cards atomically."""
