"""What a forward is told about the step it runs in: :class:`StepContext`, an explicit argument of the model's
forward (no process-global state), and the per-step protocols the training loop calls."""

from xscale.runtime.step_context import (
    ExpertExchange,
    KeyValueCache,
    Placement,
    RecurrentMemory,
    SequenceLayout,
    StepContext,
    TokenGroup,
)

__all__ = ["ExpertExchange", "KeyValueCache", "Placement", "RecurrentMemory", "SequenceLayout", "StepContext", "TokenGroup"]
