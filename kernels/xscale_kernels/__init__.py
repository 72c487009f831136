"""Triton kernels for xscale's fused ops; each module holds the @triton.jit kernels and their autograd Function.

Importing a kernel module decorates its kernels: in triton 3.9 ``@triton.jit`` reads ``TRITON_INTERPRET``
at that moment (not when triton itself is imported), so on CPU set ``TRITON_INTERPRET=1`` before the first
``import xscale_kernels.<module>``. This package's ``__init__`` imports nothing so that importing it is free.
"""
