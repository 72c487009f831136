"""Benchmarks, off the library path: each prints ratios against a baseline measured in the same run
(``xscale bench NAME``, dispatched by :mod:`xscale.commands.bench`)."""
