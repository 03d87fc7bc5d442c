"""Fabric: AtnAgent <-> FfnAgent invocation path (shared memory within one host)."""
