"""The rotary_cache family: ``flaggems::rotary_cache_append`` (a decoder attention's rotary embedding and its
DynamicCache append, one call)."""
