"""The rotary op family: ``flaggems::rotary_embedding``: q and k rotated in one call."""
