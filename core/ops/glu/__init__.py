"""The glu op family: ``flaggems::silu_mul``, ``gelu_tanh_mul`` and ``gelu_mul``: a gated MLP's ``act(gate) * up``."""
