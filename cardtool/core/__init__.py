"""Device-free domain logic: cards, discovery, lineage (and, later, loops and methods)."""
