"""Argument types shared by the command-line tools."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
