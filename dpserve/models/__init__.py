"""Model definitions; `registry.build_model` picks one by architecture."""
