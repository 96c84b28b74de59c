"""recxla's operators: torch.library registrations (fake kernels, autograd) and the public
functions that validate arguments and dispatch to the CPU, CUDA or Triton kernels."""
