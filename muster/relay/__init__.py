"""Relay servers and resumable encrypted streams for the relayed path (seed 000)."""
