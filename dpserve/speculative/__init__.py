"""Speculative decoding building blocks: draft proposers (n-gram prompt lookup) and acceptance rules.

The engine integration (scheduler, verify steps under DP attention) builds on these pure functions.
"""
