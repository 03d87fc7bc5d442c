"""CrossPool: serve many LLMs on shared hardware with FFN weights and compute in a shared pool."""

__version__ = "0.1.0"
