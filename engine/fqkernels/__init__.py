"""Triton kernels of the engine: one kernel per module, each beside its pure-torch reference."""
