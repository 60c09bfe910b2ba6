"""Control-link frames between controller and agents: kinds, byte layout, MAC."""
