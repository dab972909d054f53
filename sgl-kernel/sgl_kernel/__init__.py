"""Triton kernels for the sglang DSA fork. Every kernel has a torch reference twin (`*_ref`) in
its own module and is tested against it, on CPU under TRITON_INTERPRET=1 and on the GPU.
Modules are imported on use (`from sgl_kernel import moe`): importing one compiles nothing."""

__version__ = "0.1.0"
