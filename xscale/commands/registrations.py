"""Every layer's registrations, imported by each command before it reads a config: the config checks of the zoo,
the data and the loggers (:func:`xscale.config.check.register_check`), the model of ``checkpoint.init_from=hf:``
(:func:`xscale.config.load.register_completer`) and its weights (:mod:`xscale.checkpoint.init_sources`)."""

import xscale.data  # noqa: F401
import xscale.interop.hf.families  # noqa: F401
import xscale.interop.hf.load  # noqa: F401
import xscale.models  # noqa: F401
import xscale.train.loggers  # noqa: F401

PROVIDERS = ("xscale.models", "xscale.data", "xscale.train")
