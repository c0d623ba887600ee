"""The ``triton_xpu`` backend: the Triton kernels launched on Intel XPU."""
