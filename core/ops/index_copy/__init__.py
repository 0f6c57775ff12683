"""The index_copy op family: ``index_copy_`` / ``index_copy``: rows written at an index."""
