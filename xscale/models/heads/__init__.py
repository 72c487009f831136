"""The heads a stack's output goes to: the language-model projection (:mod:`~xscale.models.heads.lm`), the
sequence classifier (:mod:`~xscale.models.heads.classifier`) and the early exits
(:mod:`~xscale.models.heads.early_exit`)."""
