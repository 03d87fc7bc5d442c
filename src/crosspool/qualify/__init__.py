"""Qualification: numerics and structure of CrossPool against independent references."""
