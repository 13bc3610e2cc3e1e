"""Builds fairring-ffi (the Rust C ABI) into the `fairring` package.

With its `cuda` feature (the device calls) unless FAIRRING_CUDA=0: building it
needs no CUDA toolkit (the library loads the driver, NVRTC and NCCL when a
device call first needs them), and a machine without a GPU runs CPU tensors
as before.
"""

import os

from setuptools import setup
from setuptools_rust import Binding, RustExtension

CUDA = os.environ.get("FAIRRING_CUDA", "1") != "0"

setup(
    rust_extensions=[
        RustExtension(
            "fairring._fairring_ffi",
            path="../fairring-ffi/Cargo.toml",
            binding=Binding.NoBinding,
            features=["cuda"] if CUDA else [],
            # Tests and benchmarks want the optimised engine even from a
            # development install.
            debug=False,
        )
    ],
    zip_safe=False,
)
