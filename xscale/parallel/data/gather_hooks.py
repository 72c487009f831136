"""Wait for ZeRO-1/2's parameter all-gather only where the parameters are read (Megatron's ``overlap_param_gather``).

After the optimizer step the updated chunks travel while the next forward runs (:meth:`ChunkGather.start`): each module
that reads parameters first unpacks the buckets that hold them, in bucket order, so the transfer of later layers
overlaps the forward of earlier ones. Which modules wait, and for what:
- a *container* (a part, or any module above one of the model's blocks) for its own parameters only;
- every other module right under a container (a block, the embedding, the final norm, the head) for every parameter
  beneath it, so a module that reads a child's weights without calling it (stacked experts) is covered.
Reading the parameters any other way waits for every bucket: a state dict, loading one (through the same modules'
state-dict hooks), and whatever calls :meth:`DataParallel.settle` first (checkpoints, evaluation, the end of a run).
Under ``torch.compile`` the waits run eagerly, outside the compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from xscale.runtime.eager import eager_under_compile


def waiting_modules(parts: list[nn.Module], blocks: list[nn.Module]) -> list[tuple[nn.Module, bool]]:
    """``(module, recurse)`` for each module that waits: containers with ``recurse=False``, the modules right under
    them (blocks included) with ``recurse=True``. Without blocks each part waits for all its parameters."""
    block_ids = {id(block) for block in blocks}
    holds_block: dict[int, bool] = {}

    def above_a_block(module: nn.Module) -> bool:
        if id(module) not in holds_block:
            holds_block[id(module)] = any(id(child) in block_ids or above_a_block(child)
                                          for child in module.children())
        return holds_block[id(module)]

    waiting: list[tuple[nn.Module, bool]] = []

    def visit(module: nn.Module) -> None:
        if id(module) in block_ids or not above_a_block(module):
            waiting.append((module, True))
            return
        waiting.append((module, False))
        for child in module.children():
            visit(child)

    for part in parts:
        visit(part)
    return waiting


def install_gather_waits(parts: list[nn.Module], blocks: list[nn.Module], bucket_of: dict[int, int],
                         wait_through: Callable[[int], None], finish: Callable[[], None]) -> list:
    """Hooks making each waiting module's forward wait for the buckets (``bucket_of``: id(parameter) -> bucket index)
    of the parameters it reads, and any state dict of it, saved or loaded, for all of them. Returns the handles."""
    @eager_under_compile
    def finish_all(*_args, **_kwargs) -> None:
        finish()

    handles = []
    for module, recurse in waiting_modules(parts, blocks):
        buckets = [bucket_of[id(param)] for param in module.parameters(recurse=recurse) if id(param) in bucket_of]
        if buckets:
            handles.append(module.register_forward_pre_hook(_waiter(wait_through, max(buckets))))
        handles.append(module.register_state_dict_pre_hook(finish_all))
        handles.append(module.register_load_state_dict_pre_hook(finish_all))
    return handles


def _waiter(wait_through: Callable[[int], None], last: int) -> Callable:
    @eager_under_compile
    def wait(_module: nn.Module, _args) -> None:
        wait_through(last)
    return wait
