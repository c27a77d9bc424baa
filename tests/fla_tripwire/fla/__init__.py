"""Tripwire stand-in for flash-linear-attention (see ../README.md)."""
