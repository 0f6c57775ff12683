"""Small in-test plugins for the core tests (kernels run in the interpreter on CPU)."""
