"""Builds the one C++ extension (csrc/hlo_scan.cc); everything else is in pyproject.toml.

The extension uses only the CPython C API (no torch, no XLA headers), so it
builds with the compiler pip finds, before torch is installed.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "torch_scan_hop._hlo_scan",
    sources=["csrc/hlo_scan.cc"],
    depends=["csrc/hlo_proto.h", "csrc/hlo_py.h", "csrc/hlo_signature.h", "csrc/hlo_step.h", "csrc/hlo_straight.h",
             "csrc/hlo_rows.h", "csrc/hlo_stacked.h"],
    extra_compile_args=["-std=c++17", "-O2"],
    language="c++",
)])
