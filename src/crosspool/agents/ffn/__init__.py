"""FFN execution inside an FfnAgent: weight loading and the layer math."""
