"""Engine-neutral FFN semantics of model families: architecture -> per-layer FFN spec."""
