"""The repeat_interleave op family: ``repeat_interleave``'s three overloads."""
