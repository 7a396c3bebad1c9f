"""Migration service: moves in-flight requests off failed or drained workers (see core.py)."""
