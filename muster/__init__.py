"""muster: run one PyTorch training job across many machines as a gang."""

__version__ = "0.1.0"
