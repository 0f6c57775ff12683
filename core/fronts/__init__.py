"""Public op fronts: the torch semantics every implementation of an op needs, once.

A front checks the arguments as torch does (declining, with ``Decline``, every
call torch would reject, so that the native kernel raises torch's own error),
wraps dims, declines overlapping destinations, validates indices where the
checking contract asks (``FLAGGEMS_CHECK_INDICES``, the interpreter), allocates
the output as torch lays it out, and hands a kernel one normalised call. A
vendor writes only the kernel part:

    from flaggems.fronts import index_copy

    def scatter(call: index_copy.Call) -> None: ...   # the vendor's kernel launch

    index_copy_, index_copy_out_of_place = index_copy.entries(scatter)

One module per op; a front imports no kernel (no Triton).
"""
