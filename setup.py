"""The one C extension: both ends of a layer call (src/crosspool/transport/_calls.c), plain C over
shared memory with no engine or torch headers. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "crosspool.transport._calls",
            ["src/crosspool/transport/_calls.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
        )
    ]
)
