"""The layer_scale op family: ``flaggems::layer_scale`` (a vision transformer's per-channel LayerScale)."""
