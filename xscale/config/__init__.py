"""A run's configuration: the typed sections (:mod:`~xscale.config.schema`), reading YAML and dotted overrides
(:mod:`~xscale.config.load`: ``load_config``) and the checks before anything is built (:mod:`~xscale.config.check`,
to which the layers above register theirs). The package imports nothing else of xscale."""
