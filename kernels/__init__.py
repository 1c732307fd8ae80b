"""Fused Triton kernels for lowmemopt (installed as ``lowmemopt.kernels``)."""
