"""Command-line entry points (the only layer that imports Hydra)."""
