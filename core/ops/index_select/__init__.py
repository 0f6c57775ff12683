"""The index_select op family: ``index_select``: rows gathered at an index."""
