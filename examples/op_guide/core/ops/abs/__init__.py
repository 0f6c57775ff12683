"""The abs op family: ``aten::abs``."""
