"""DeepNorm's constants (Wang et al. 2022, "DeepNet", sec. 3 and fig. 2): x_{l+1} = LN(alpha x_l + G(x_l)), with
the FFN, value and output projections initialised Xavier-normal with gain beta (queries and keys with gain 1).

  encoder-only / decoder-only, N layers:       alpha = (2N)^(1/4),                beta = (8N)^(-1/4)
  encoder-decoder, N encoder / M decoder:      encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16)
                                               decoder alpha = (3M)^(1/4),          beta = (12M)^(-1/4)
"""

from __future__ import annotations

import math

from xscale.config.schema import ModelConfig

# The projections initialised with gain beta (in a block's attention or feed-forward sub-layer); wq, wk get gain 1.
BETA_PROJECTIONS = ("wv", "wo", "w_in", "w_out", "w_gate", "w_up", "w_down")
UNIT_PROJECTIONS = ("wq", "wk")


def deepnorm_scales(config: ModelConfig, in_decoder: bool) -> tuple[float, float]:
    """(alpha, beta) for a block of the encoder (or the only stack) or, ``in_decoder``, of an encoder-decoder's
    decoder."""
    if config.family != "encoder_decoder":
        return (2 * config.n_layers) ** 0.25, (8 * config.n_layers) ** -0.25
    encoder, decoder = config.n_layers, config.decoder_layers
    if in_decoder:
        return (3 * decoder) ** 0.25, (12 * decoder) ** -0.25
    return 0.81 * (encoder**4 * decoder) ** (1 / 16), 0.87 * (encoder**4 * decoder) ** (-1 / 16)


def deepnorm_init_std(name: str, shape: tuple[int, ...], config: ModelConfig) -> float | None:
    """The Xavier-normal std of a block projection's weight under DeepNorm, std = gain sqrt(2 / (fan_in + fan_out));
    None for every other parameter (its usual init)."""
    parts = name.split(".")
    if len(shape) != 2 or parts[-1] != "weight" or len(parts) < 3 or parts[-3] != "sublayer":
        return None
    projection = parts[-2]
    if projection in UNIT_PROJECTIONS:
        gain = 1.0
    elif projection in BETA_PROJECTIONS:
        gain = deepnorm_scales(config, in_decoder=parts[0] == "decoder")[1]
    else:
        return None
    fan_out, fan_in = shape
    return gain * math.sqrt(2.0 / (fan_in + fan_out))
