"""Control plane: member supervision, lifecycle, the front endpoint (never on the per-layer path)."""
