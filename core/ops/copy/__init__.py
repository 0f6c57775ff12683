"""The copy op family: ``copy_`` and ``_to_copy``: copies between layouts and dtypes."""
