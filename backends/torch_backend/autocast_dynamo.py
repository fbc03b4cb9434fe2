"""What dynamo is told about ``amp.autocast`` objects that it does not find out itself.

A block object made *outside* the compiled function (``CTX = amp.autocast(...)`` at
module level, or ``ctx = nullcontext() if cpu else amp.autocast(...)`` before the
compiled step) reaches dynamo as an existing object. dynamo enters an existing object
in a ``with`` statement only if it is one of the context managers it knows
(``torch.autocast`` objects, grad modes, torch function modes, ...); torch 2.7-2.13
wrap any other object as a plain user object, which it refuses to enter ("Unsupported
context manager": a graph break, and an error under ``fullgraph=True``). torch 2.14
wraps an existing object with ``__enter__`` and ``__exit__`` as it wraps one made inside
the compiled function: its ``__enter__`` and ``__exit__`` are traced (inlined).

``install()`` gives dynamo that rule for ``amp.autocast`` objects on every torch, through
the table of exact types dynamo's ``VariableBuilder`` consults first: an existing block
object is wrapped as a ``GenericContextWrappingVariable``, the variable dynamo makes for a
block made inside the compiled function, so both compile to the same graph. The
object's identity is guarded (another block object is another graph), and its token
stack, pushed on entry and popped on exit, is tracked as any mutated attribute is.
Private API: ``tests/native/test_torch_compile_first_use.py`` fails loudly when a torch
release moves it (docs/COMPILE.md, "dynamo internals the adapter relies on").
"""

from __future__ import annotations

from typing import Any


def _wrap_existing_block(builder: Any, value: Any) -> Any:
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.variables.ctx_manager import GenericContextWrappingVariable

    builder.install_guards(GuardBuilder.ID_MATCH)
    var = GenericContextWrappingVariable(value, source=builder.source)
    return builder.tx.output.side_effects.track_object_existing(value, var)


def install(block_class: type) -> bool:
    """Has dynamo wrap existing ``block_class`` objects as context managers it traces.

    Returns whether it could (False where dynamo's table is not where it was: then a
    block made outside a compiled function breaks the graph at its ``with``, as it did
    before, and ``fullgraph=True`` raises dynamo's ``Unsupported``)."""
    try:
        from torch._dynamo.variables.builder import VariableBuilder

        tables = [VariableBuilder._type_dispatch_impl(trace_numpy)
                  for trace_numpy in (False, True)]
    except Exception:
        return False
    for table in tables:
        if not isinstance(table, dict):
            return False
        table[block_class] = _wrap_existing_block
    return True


def never_a_frame_of_its_own(*functions: Any) -> None:
    """Makes dynamo run these functions, and all they call, as they are whenever they are
    called from code that runs eagerly inside a compiled call (a frame dynamo gave up on
    after a graph break inside a block); compiled code still inlines them.

    Compiled as frames of their own, a block's entry would switch autocast on inside a
    graph of its own, whose switches AOTAutograd drops, and its exit would meet
    torch.autocast objects made eagerly, which dynamo cannot leave (torch 2.14), or a
    traced block it cannot rebuild (torch 2.7-2.10). Not skipped (torch 2.7-2.8), the
    block sees such a compile (autocast.py's `_block_is_its_own_frame`) and enters and
    leaves eagerly.
    """
    from torch._C._dynamo import eval_frame

    skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP,
                                         eval_frame._FrameAction.SKIP)
    for fn in functions:
        eval_frame.set_code_exec_strategy(fn.__code__, skip)
