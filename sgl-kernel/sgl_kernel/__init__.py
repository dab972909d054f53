"""Triton kernels for the sglang DSA fork; every kernel has a torch reference twin in
`sgl_kernel.ref` and is tested against it (on CPU under TRITON_INTERPRET=1)."""

__version__ = "0.1.0"
