"""eager_under_compile: torch._dynamo stays unimported until torch.compile is used, and a compiled caller still runs
the function eagerly (what torch.compiler.disable promises)."""

import subprocess
import sys

import torch

from xscale.runtime.eager import eager_under_compile


def test_a_compiled_caller_runs_the_function_eagerly():
    compiling_inside = []

    @eager_under_compile
    def double(x: torch.Tensor) -> torch.Tensor:
        compiling_inside.append(torch.compiler.is_compiling())  # True only while dynamo traces it
        return x * 2

    compiled = torch.compile(lambda x: double(x + 1) - 1, backend="eager")
    for _ in range(2):
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert compiling_inside == [False, False]


def test_decorating_imports_no_dynamo():
    code = ("import sys\nfrom xscale.runtime.eager import eager_under_compile\n"
            "f = eager_under_compile(lambda x: x + 1)\nassert f(1) == 2\nprint('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
