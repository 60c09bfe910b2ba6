"""Typed HTTP client for the controller API (CLI, agent, tests, Python SDK)."""
