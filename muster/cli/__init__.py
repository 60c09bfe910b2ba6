"""The muster command line."""
