"""Builds fairring-ffi (the Rust C ABI) into the `fairring` package."""

from setuptools import setup
from setuptools_rust import Binding, RustExtension

setup(
    rust_extensions=[
        RustExtension(
            "fairring._fairring_ffi",
            path="../fairring-ffi/Cargo.toml",
            binding=Binding.NoBinding,
            # Tests and benchmarks want the optimised engine even from a
            # development install.
            debug=False,
        )
    ],
    zip_safe=False,
)
