"""Triton kernels for gaugeopt (installed as ``gaugeopt.kernels``)."""
