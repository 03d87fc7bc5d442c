"""The front endpoint: the one OpenAI-compatible HTTP endpoint of a deployment (its own process)."""
