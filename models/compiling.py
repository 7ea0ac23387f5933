"""What torch.compile needs of the project's code, without Megatron-Core (a dry run imports the rollout
engine, which uses it)."""

from __future__ import annotations

import types


def code_copy(function: types.FunctionType) -> types.FunctionType:
    """``function`` with a code object of its own (the same code): dynamo keeps its compiled graphs, and
    counts them against torch._dynamo.config.recompile_limit, on the code object, so the copy's graphs
    are its own."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
