"""The private torch and dynamo APIs the torch adapter relies on (docs/COMPILE.md,
"dynamo internals the adapter relies on"), each asked here directly, so that a torch
release that moves one fails here by name instead of the adapter falling back silently
(several of its probes answer "no" when an internal is missing). The behaviour each one
gives is tested where it is used; this file is the alarm."""

import pytest
import torch

from unified_amp.backends.torch_backend import autocast as torch_autocast
from unified_amp.backends.torch_backend import autocast_dynamo

VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def test_outside_blocks_are_registered_in_dynamos_type_table():
    """autocast_dynamo.install() returns False where VariableBuilder._type_dispatch_impl
    moved; a block made outside a compiled function would then break the graph at its
    ``with`` (and raise under fullgraph=True) on the torches that need the rule."""
    from torch._dynamo.variables.builder import VariableBuilder

    assert torch_autocast.OUTSIDE_BLOCKS_TRACED
    for trace_numpy in (False, True):
        table = VariableBuilder._type_dispatch_impl(trace_numpy)
        assert table[torch_autocast.amp_autocast] is autocast_dynamo._wrap_existing_block


def test_the_names_the_outside_block_rule_builds_with_exist():
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.variables.ctx_manager import GenericContextWrappingVariable
    from torch._dynamo.variables.user_defined import UserDefinedObjectVariable

    assert hasattr(GuardBuilder, "ID_MATCH")
    assert issubclass(GenericContextWrappingVariable, UserDefinedObjectVariable)
    from torch._dynamo.side_effects import SideEffects

    assert hasattr(SideEffects, "track_object_existing")


def test_assume_constant_results_marker_is_the_attribute_the_library_sets():
    """The registry (core, by name) and the adapter mark functions dynamo must run as
    they are while tracing with the attribute torch.compiler.assume_constant_result
    sets."""
    marked = torch.compiler.assume_constant_result(lambda: 1)
    assert getattr(marked, "_dynamo_marked_constant", False) is True


def test_the_frame_exec_strategy_api_the_skip_marks_use():
    from torch._C._dynamo import eval_frame

    strategy = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP,
                                             eval_frame._FrameAction.SKIP)
    assert callable(eval_frame.set_code_exec_strategy) and strategy is not None


def test_dynamo_types_autocast_objects_from_torch_2_12():
    """_NATIVE (AutocastModeVariable defines python_type) decides whether a plain
    contract=False block may be a torch.autocast while dynamo traces."""
    assert torch_autocast._NATIVE == (VERSION >= (2, 12))


def test_the_torch_function_mode_stack_api():
    for name in ("_len_torch_function_stack", "_get_function_stack_at",
                 "_push_on_torch_function_stack", "_pop_torch_function_stack",
                 "_is_torch_function_mode_enabled", "_dispatch_has_kernel_for_dispatch_key"):
        assert callable(getattr(torch._C, name)), name
    # the contract's table checked against torch's dispatcher: CPU autocast has no
    # softmax kernel (so the contract casts there), CUDA autocast has one
    from unified_amp.backends.torch_backend import dtype_contract

    assert torch.softmax in dtype_contract.HANDLERS
    assert dtype_contract.handled_devices(dtype_contract.table.row("softmax")) == {"cpu"}


def test_the_instruction_translator_the_adapter_reads_while_tracing():
    """_traced_frame_code (the CompileWarning's bookkeeping) and
    _made_for_a_with_statement read dynamo's current InstructionTranslator: its f_code,
    instruction_pointer and instructions[...].opname."""
    seen = {}

    def probe():
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        seen["code"] = tx.f_code
        seen["opname"] = tx.instructions[tx.instruction_pointer].opname
        return 0

    probe._dynamo_marked_constant = True

    def f(x):
        return x + probe()

    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(1))
    torch._dynamo.reset()
    assert seen["code"] is f.__code__
    assert isinstance(seen["opname"], str)


def _helper(x):
    return x + 1


def test_the_guard_finalizers_release_dead_guards_reads():
    """autocast_dynamo.release_dead_guards finds dynamo's invalidation finalizers in
    weakref.finalize's registry (a functools.partial of the guards' manager's bound
    ``invalidate``), tells compiled code that is gone by its cache entry (None after a
    reset, set while the code lives), and a frame by its globals. Any of these moved, it
    releases nothing and the leak test fails; this names what moved."""
    import weakref

    from torch._guards import CompileContext

    def managers_guarding(obj):
        found = [autocast_dynamo._guard_manager_of(info)
                 for info in weakref.finalize._registry.values() if info.weakref() is obj]
        return [manager for manager in found if manager is not None]

    seen = {}

    def probe():
        seen["context"] = CompileContext.try_get()
        return 0

    probe._dynamo_marked_constant = True

    def g(x):
        return _helper(x) + probe()

    torch._dynamo.reset()
    before = managers_guarding(_helper.__code__)
    compiled = torch.compile(g, backend="eager")
    compiled(torch.ones(1))
    assert isinstance(seen["context"], CompileContext)
    managers = [m for m in managers_guarding(_helper.__code__) if m not in before]
    assert len(managers) == 1  # the code of a global function is matched by identity
    manager = managers[0]
    assert manager.guard_manager.cache_entry is not None
    assert manager.guard_manager.global_scope["G"] is globals()
    assert not autocast_dynamo._has_no_compiled_code(manager)
    torch._dynamo.reset()
    assert manager.guard_manager.cache_entry is None
    assert autocast_dynamo._has_no_compiled_code(manager)


@pytest.mark.parametrize("name", ["_amp_foreach_non_finite_check_and_unscale_",
                                  "_amp_update_scale_", "_foreach_add_", "_foreach_copy_"])
def test_the_fused_kernels_the_scaler_and_opt_levels_call(name):
    assert callable(getattr(torch, name))
