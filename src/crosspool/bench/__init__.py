"""Benchmarks, always side by side with the native engine in the same run."""
