"""Pallas GPU attention kernels for jaxspec, each with a pure-JAX reference in the same file."""
