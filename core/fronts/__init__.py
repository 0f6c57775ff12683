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

One module per op; a front imports no kernel (no Triton):

* :mod:`.copy`: ``copy_`` and ``_to_copy`` around ``copy_dense`` / ``copy_strided``;
* :mod:`.index_copy`: ``index_copy_`` / ``index_copy`` around ``scatter(call)``;
* :mod:`.index_select`: ``index_select`` around ``gather(call)``;
* :mod:`.repeat_interleave`: the three overloads around ``expand`` and ``gather``;
* :mod:`.group_norm`: ``native_group_norm`` / ``native_group_norm_backward``
  around forward and backward kernels, and the checks and layout decisions
  of ``aten::group_norm`` (plus a forward-only entry for it);
* :mod:`.unfold`: the ``unfold`` view itself, and ``unfold_backward`` around
  a backward kernel.

Fronts with per-call ``Call`` records use slotted or frozen dataclasses only
where that costs under ~0.3 µs a call; the hottest (``copy_``,
``repeat_interleave``) pass plain arguments.
"""
