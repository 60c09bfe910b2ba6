"""Gang network set-up per path class, the probe, mesh addressing (seed 000)."""
