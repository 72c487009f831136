"""Hugging Face ``transformers`` interop: one family per file (GPT-2, Llama, BERT, T5), each a config map and a list of
tensor rules that run both ways; :mod:`~xscale.interop.hf.load` reads an HF folder, :mod:`~xscale.interop.hf.save`
writes one from an xscale checkpoint."""
