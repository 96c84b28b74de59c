"""recxla's Triton kernels, installed as recxla.triton_kernels (one module per op family).

This file makes the folder a regular package: as a namespace package, an editable install cannot
import `recxla.triton_kernels` once `recxla` itself was found through the source tree.
"""
