"""The unfold op family: ``unfold`` (the view) and ``unfold_backward``."""
