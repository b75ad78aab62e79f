"""fspeed.kernels: Numba kernels (CPU and CUDA) over flat buffers.

This package imports nothing of fspeed, so each kernel can be read and tested alone.
Every kernel has a pure-torch reference in the layer that calls it.
"""
