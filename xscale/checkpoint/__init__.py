"""Checkpoints as a library that ``train``, ``interop`` and the commands share: the on-disk format and atomic saves
(:mod:`~xscale.checkpoint.checkpointer`), integrity and safe reading (:mod:`~xscale.checkpoint.integrity`), and the
sources of initial weights other layers register (:mod:`~xscale.checkpoint.init_sources`)."""
