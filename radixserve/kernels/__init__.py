"""Kernels: Triton kernels beside their torch references (triton/), C kernels for CPU
(csrc/, built by native_build.py and bound in native_attention.py / native_ops.py)."""
