"""Image-classification training with PyTorch: python -m <package>.train / .evaluate / .export."""

__version__ = "0.1.0"
