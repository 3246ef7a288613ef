"""Build script for offload-zero.

The C++ extension ``offload_zero._C`` holds the host-side Adam/AdamW kernels. It is built with
pybind11 only (never against torch's C++ headers): the kernels take raw pointers and sizes.
Each instruction set is its own translation unit compiled with its own flags, and the best one
is chosen at run time from cpuid, so the build machine's CPU never decides what runs.
"""
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

_COMMON = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-pthread"]


class _PerFileFlagsBuildExt(build_ext):
    """``build_ext`` that adds instruction-set flags to the one source file that needs them."""

    _ISA_FLAGS = {
        "adam_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
        "adam_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                            "-mfma", "-mf16c"],
    }

    def build_extensions(self):
        compiler = self.compiler
        original = compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = list(extra_postargs)
            for name, flags in self._ISA_FLAGS.items():
                if src.endswith(name):
                    extra += flags
            return original(obj, src, ext, cc_args, extra, pp_opts)

        compiler._compile = _compile
        super().build_extensions()


ext_modules = [
    Pybind11Extension(
        "offload_zero._C",
        sources=[
            "csrc/bindings.cpp",
            "csrc/adam_scalar.cpp",
            "csrc/adam_avx2.cpp",
            "csrc/adam_avx512.cpp",
            "csrc/dispatch.cpp",
        ],
        include_dirs=["csrc"],
        extra_compile_args=_COMMON,
        extra_link_args=["-pthread"],
        cxx_std=17,
    ),
]

setup(
    name="offload-zero",
    version="0.1.0",
    description="ZeRO stage 1/2/3 training with CPU and NVMe offload for PyTorch models",
    packages=find_packages(include=["offload_zero", "offload_zero.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy", "psutil", "libaio", "safetensors"],
    extras_require={
        "train": ["transformers>=4.40", "tqdm", "matplotlib"],
        "test": ["pytest", "transformers>=4.40", "peft", "accelerate"],
    },
    entry_points={"console_scripts": ["offload-zero=offload_zero.cli:main"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": _PerFileFlagsBuildExt},
    zip_safe=False,
)
