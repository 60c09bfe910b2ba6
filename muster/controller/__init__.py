"""The controller: FastAPI app, agents' control links, supervision loop (seed 001)."""
