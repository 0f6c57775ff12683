"""The group_norm op family: ``native_group_norm``, its backward, ``aten::group_norm``, and
``flaggems::group_norm_silu`` (a UNet block's GroupNorm then SiLU, on the same kernels)."""
