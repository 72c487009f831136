"""Imports every component module so that each registers itself."""

import xscale.models.attention  # noqa: F401
import xscale.models.blocks  # noqa: F401
import xscale.models.ffn  # noqa: F401
import xscale.models.heads.replaced_token_detection  # noqa: F401
import xscale.models.heads.sentence_pair  # noqa: F401
import xscale.models.heads.span_boundary  # noqa: F401
import xscale.models.moe  # noqa: F401
import xscale.models.norm  # noqa: F401
import xscale.models.position  # noqa: F401
import xscale.models.positions  # noqa: F401
import xscale.models.product_key  # noqa: F401
import xscale.models.stacks  # noqa: F401
