"""meshtrain: parallel training of AI models on PyTorch's own distributed engine."""

__version__ = "0.1.0"
