"""Gang networking (seed 000): the direct path's WireGuard device, next to the job."""
