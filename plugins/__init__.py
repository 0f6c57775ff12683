"""Plugins shipped with flaggems-core (the generic Triton kernels)."""
