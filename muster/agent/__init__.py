"""The agent: dial-in, inventory, torchrun launcher, per-rank log capture, uploads (seed 001)."""
