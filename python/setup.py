"""Builds fairring-ffi (the Rust C ABI) and the C++ torch.distributed backend
over it (`fairring._c10d`, built against the torch installed where the package
is built: `pip install --no-build-isolation ./python`) into the `fairring`
package.

With its `cuda` feature (the device calls) unless FAIRRING_CUDA=0: building it
needs no CUDA toolkit (the library loads the driver, NVRTC and NCCL when a
device call first needs them), and a machine without a GPU runs CPU tensors
as before.
"""

import os
import sys

from setuptools import setup
from setuptools_rust import Binding, RustExtension
from setuptools_rust.build import build_rust

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "fairring: building the package needs torch, installed where it is built: its "
        "torch.distributed backend is a C++ c10d::Backend compiled against that torch. "
        "Install torch first, then build without an isolated environment: "
        "`pip install --no-build-isolation ./python` (with setuptools >= 77 and setuptools-rust installed)"
    )

CUDA = os.environ.get("FAIRRING_CUDA", "1") != "0"
HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"


def _progress_to_terminal():
    """pip keeps a build's output until it ends, and shows it only with -v or
    on failure: where the build has a terminal, its output (cargo's progress
    and the compiler's) goes there as it is written. FAIRRING_BUILD_QUIET=1
    leaves it to pip."""
    if os.environ.get("FAIRRING_BUILD_QUIET") == "1":
        return
    try:
        tty = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        return  # no terminal (CI, a pipe): pip's own log has everything
    sys.stderr.flush()
    os.dup2(tty, 2)
    os.close(tty)


def _say(line):
    print(f"fairring: {line}", file=sys.stderr, flush=True)


class BuildExtensions(BuildExtension):
    """Builds the C++ backend, then (setuptools-rust's part) the library,
    saying what it builds. With ninja installed (`pip install ninja`), torch
    compiles the backend's sources in parallel (MAX_JOBS of them at once,
    default every core); without it, one after another."""

    def run(self):
        _progress_to_terminal()
        _say(f"compiling the C++ torch.distributed backend against torch {torch.__version__}")
        super().run()


class BuildRust(build_rust):
    def run(self):
        _say(
            "building the Rust library (fairring-ffi) with cargo "
            f"({'with' if CUDA else 'without'} its CUDA calls): a minute or more from a clean tree"
        )
        super().run()

import torch  # noqa: E402  (found above)

setup(
    ext_modules=[
        CppExtension(
            "fairring._c10d",
            sources=[
                os.path.join(CSRC, name)
                for name in ("backend.cpp", "works.cpp", "dispatcher.cpp", "library.cpp")
            ],
            depends=[
                os.path.join(CSRC, name)
                for name in ("fairring_c10d.hpp", "dispatcher.hpp", "library.hpp")
            ]
            + [os.path.join("..", "fairring-ffi", "include", "fairring.h")],
            include_dirs=[os.path.join(HERE, "..", "fairring-ffi", "include")],
            extra_compile_args=[
                "-std=c++20",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                # pybind11 objects are hidden: so is what holds them.
                "-fvisibility=hidden",
                # The torch it was built against, which the package checks at import.
                f'-DFAIRRING_TORCH_VERSION="{torch.__version__}"',
            ],
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": BuildExtensions, "build_rust": BuildRust},
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
