"""Attention backends over the paged KV pool (design section 9)."""
