"""The ``triton`` backend: fused vocabulary-parallel Triton kernels (CUDA; CPU under TRITON_INTERPRET=1)."""
