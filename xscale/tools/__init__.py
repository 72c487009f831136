"""Commands that are not the training path: ``inspect`` (parameters, FLOPs, memory per rank), ``parity`` (loss
curves across layouts), ``export`` (a checkpoint's weights to safetensors) and ``bench`` (benchmarks, each a ratio
against a baseline measured in the same run)."""
