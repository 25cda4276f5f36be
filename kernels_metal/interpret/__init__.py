"""A CPU interpreter for `mx.fast.metal_kernel`: compiles the Metal source MLX would generate as
C++ against a shim of the Metal Shading Language and runs each threadgroup's threads as
cooperative fibers, so barriers and SIMD-group operations behave. See README.md for its limits."""

from .compiler import MetalCompileError, MetalInterpretError
from .kernel import MetalKernel, metal_kernel

__all__ = ["MetalCompileError", "MetalInterpretError", "MetalKernel", "metal_kernel"]
