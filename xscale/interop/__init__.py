"""Weights in and out of xscale: Hugging Face ``transformers`` checkpoints (:mod:`xscale.interop.hf`) and xscale's
own one-file safetensors export (:func:`load_exported`)."""

from xscale.interop.exported import load_exported

__all__ = ["load_exported"]
