"""The rms_norms op family: ``flaggems::rms_norm`` and ``flaggems::add_rms_norm`` (a decoder's RMSNorm and
the residual add before it)."""
