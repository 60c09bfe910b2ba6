"""Training-side library; the only package that imports torch (seed 002)."""
