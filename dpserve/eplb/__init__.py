"""Expert-parallel load balancing: redundant experts placed from recorded load."""
