"""SGLang integration: the only package that imports sglang (and its kernel package sgl_kernel)."""
