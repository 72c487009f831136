"""xscale: distributed training of Transformer variants."""

__version__ = "0.1.0"
