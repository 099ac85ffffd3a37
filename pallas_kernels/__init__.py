"""Pallas GPU attention kernels for jaxspec, each with a pure-JAX reference in the same file (the
NSA kernels' reference is the model's own, `jaxspec.model.nsa`)."""
