"""Contract cases, one module per operator; each calls ``register_cases``."""
