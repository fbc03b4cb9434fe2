"""What ``amp.initialize`` changes on models and optimizers, and the per-optimizer
bookkeeping that ``amp.scale_loss`` drives.

apex changes the objects it is given in place, and code written for it relies on that
(``model(x)`` and ``optimizer.step()`` keep their names), so this does too:

- a model's ``forward`` is replaced by one that casts floating inputs to the low dtype
  (when the weights are cast), runs the original under ``amp.autocast`` (O1, O2) and
  returns low-precision outputs as float32;
- an optimizer's ``param_groups`` hold float32 master weights in place of the model's
  low-precision ones (O2), and its ``step`` skips once after an overflow and copies
  the masters back into the model after a real step; its ``state_dict`` carries the
  master weights, so a checkpoint resumes bit for bit.

The replacements are methods bound to the object (``types.MethodType``) that keep their
state in one attribute of it, so ``copy.deepcopy`` of a model or an optimizer rebinds
them to the copy, and a torch LR scheduler can wrap ``step`` as it wraps the original.
"""

from __future__ import annotations

import types
from typing import Any

from . import _stale
from ..interface import LOW_PRECISION
from .._registry import get_backend
from .._casting import _cast_tree
from ..autocast import autocast

MASTER_KEY = "unified_amp_master_weights"  # the optimizer state_dict entry (O2)
_MODEL_ATTR = "_unified_amp_forward"
_OPT_ATTR = "_unified_amp"


def check_fresh(models: list[Any], optimizers: list[Any]) -> None:
    """Raises RuntimeError if a model or optimizer went through initialize already."""
    for kind, objs, attr in (("model", models, _MODEL_ATTR),
                             ("optimizer", optimizers, _OPT_ATTR)):
        for obj in objs:
            if getattr(obj, attr, None) is not None:
                raise RuntimeError(
                    f"This {kind} ({type(obj).__name__}) went through amp.initialize()"
                    f" already; it cannot be prepared twice (its weights may be cast and its"
                    f" step replaced). Build a fresh float32 {kind}, and pass every model"
                    f" and optimizer to one amp.initialize() call.")


def prepare(state: Any, models: list[Any], optimizers: list[Any]) -> None:
    """Casts the models, makes master weights and wraps forwards and steps, as
    ``state.props`` says."""
    props, backend = state.props, state.backend
    opt_params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    # Masters are copied before the cast, from the exact float32 weights (apex copied
    # them after, from the rounded ones).
    snapshots: dict[int, Any] = {}
    if props.casts_model and props.master_weights:
        for p in opt_params:
            if id(p) not in snapshots and backend.dtype_name(p.dtype) == "float32":
                snapshots[id(p)] = backend.master_copy(p)
    if props.casts_model:
        from ..pinning import pinned_modules  # (pinning imports this module)

        for model in models:
            # Modules pinned by amp.keep_float32 keep float32 weights, and need no masters.
            backend.cast_module(model, props.cast_model_type,
                                bool(props.keep_batchnorm_fp32),
                                skip=pinned_modules(model, backend))
    for model in models:
        # On the model's device: a block with no device covers CUDA alone where torch
        # sees a GPU (docs/API.md, "Devices"), and would leave a CPU model in float32.
        params = list(model.parameters())
        setattr(model, _MODEL_ATTR, _Forward(
            model.forward,
            inputs=props.cast_model_type if props.casts_model else None,
            autocast_dtype=props.low_dtype if props.autocast else None,
            device=backend.device_type(params[0]) if params else None))
        if props.opt_level != "O0":
            model.forward = types.MethodType(_amp_forward, model)
    for opt in optimizers:
        seen: set[int] = set()
        pairs = []
        for p in (p for g in opt.param_groups for p in g["params"]):
            if id(p) in snapshots and id(p) not in seen and \
                    backend.dtype_name(p.dtype) in LOW_PRECISION:
                seen.add(id(p))
                pairs.append((p, snapshots[id(p)]))
        if pairs:
            _replace_params(opt, pairs, backend.optimizer_state(opt))
            state.master_of.update((id(p), m) for p, m in pairs)
        info = _OptimizerAmp(state, opt, pairs)
        state.add_info(info)
        setattr(opt, _OPT_ATTR, info)
        if props.scales_loss or pairs:
            opt.step = types.MethodType(_amp_step, opt)
        if pairs:
            opt.state_dict = types.MethodType(_amp_state_dict, opt)
            opt.load_state_dict = types.MethodType(_amp_load_state_dict, opt)


def _replace_params(optimizer: Any, pairs: list[tuple[Any, Any]],
                    per_param_state: Any) -> None:
    """Puts each ``new`` in place of ``old`` in the optimizer's param_groups and its
    per-parameter state (both frameworks spell param_groups the same way)."""
    new = {id(old): master for old, master in pairs}
    for group in optimizer.param_groups:
        group["params"] = [new.get(id(p), p) for p in group["params"]]
    for old, master in pairs:
        if old in per_param_state:
            per_param_state[master] = per_param_state.pop(old)


def info_of(optimizer: Any) -> "_OptimizerAmp | None":
    return getattr(optimizer, _OPT_ATTR, None)


def state_of(optimizers: list[Any], latest: Any) -> Any:
    """The initialize() state that prepared all of ``optimizers``."""
    states: list[Any] = []
    for opt in optimizers:
        info = info_of(opt)
        if info is None:
            if latest is None:
                raise RuntimeError(
                    "amp.scale_loss() was called before amp.initialize(). Call"
                    " `model, optimizer = amp.initialize(model, optimizer, opt_level=...)`"
                    " first.")
            raise RuntimeError(
                f"amp.scale_loss got an optimizer ({type(opt).__name__}) that"
                f" amp.initialize() did not prepare. Pass it to amp.initialize() and use"
                f" the optimizer it returns.")
        if all(info.state is not s for s in states):
            states.append(info.state)
    if len(states) != 1:
        raise RuntimeError(
            f"amp.scale_loss got optimizers prepared by {len(states)} different"
            f" amp.initialize() calls; one backward pass uses one call's loss scalers."
            f" Pass the models and optimizers that share losses to one amp.initialize().")
    return states[0]


# -- models -----------------------------------------------------------------------------
class _Forward:
    """A model's original forward and what to do around it."""

    def __init__(self, inner: Any, inputs: str | None, autocast_dtype: str | None,
                 device: str | None = None):
        self.inner = inner
        self.inputs = inputs
        self.autocast = None if autocast_dtype is None else \
            autocast(dtype=autocast_dtype, device=device)


def _amp_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
    fw = getattr(module, _MODEL_ATTR)
    backend = get_backend()
    if fw.inputs is not None:
        args = _cast_tree(args, fw.inputs, backend, only_low=False)
        kwargs = _cast_tree(kwargs, fw.inputs, backend, only_low=False)
    if fw.autocast is not None:
        with fw.autocast:
            out = fw.inner(*args, **kwargs)
    else:
        out = fw.inner(*args, **kwargs)
    # float32 outputs, as apex's O2/O3 return: the loss is computed outside the model,
    # in float32 (MegEngine cannot even backpropagate a loss that mixes a float16 output
    # with float32 tensors outside autocast).
    return _cast_tree(out, "float32", backend, only_low=True)


# -- optimizers ---------------------------------------------------------------------------
class _OptimizerAmp:
    """One optimizer's part in scale_loss: its master weights, the gradients set aside
    while another loss's are unscaled, and whether its next step is skipped."""

    def __init__(self, state: Any, optimizer: Any, pairs: list[tuple[Any, Any]]) -> None:
        self.state = state
        self.backend = state.backend
        self.optimizer = optimizer
        self.model_params = [p for p, _ in pairs]  # low precision, in the model
        self.masters = [m for _, m in pairs]  # float32, in param_groups
        self.inner_step = optimizer.step
        self.inner_state_dict = optimizer.state_dict
        self.inner_load_state_dict = optimizer.load_state_dict
        self.skip_next = False
        self.scaled_by: int | None = None  # loss_id of gradients left scaled (delay_unscale)
        self.stash: tuple[list[Any], list[Any]] | None = None
        self._started = False
        # gradients another loss's block scaled and nothing will unscale (_stale.py)
        self.stale = _stale.StaleGrads(self.backend)

    def params(self) -> list[Any]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def begin_pass(self, loss_id: int) -> None:
        """Sets aside the gradients that are already there (unscaled, from another
        scale_loss), so that only this pass's are unscaled by this loss's scale."""
        self._started = self.scaled_by is None
        if not self._started:
            if self.scaled_by != loss_id:
                raise RuntimeError(
                    f"amp.scale_loss(loss_id={loss_id}): this optimizer's gradients are"
                    f" still scaled by loss scale {self.scaled_by} (an earlier pass used"
                    f" delay_unscale=True), and one unscale cannot undo two different"
                    f" scales. Finish with loss_id={self.scaled_by}, or don't delay.")
            return
        if self.model_params:
            # Gradients on the low-precision weights that no scale_loss moved to the
            # masters are stale (another loss's backward went through this model):
            # dropped, as apex does.
            self.backend.drop_grads(self.model_params)
        params = self.params()
        stashed = self.backend.take_grads(params)
        self.stash = (params, stashed) if any(g is not None for g in stashed) else None

    def abort_pass(self) -> None:
        """The block raised: put back what begin_pass set aside."""
        if self._started and self.stash is not None:
            self.backend.restore_grads(*self.stash)
        if self._started:
            self.stash = None

    def collect_grads(self) -> list[Any]:
        """Moves the model's low-precision gradients to the masters; returns the
        parameters whose gradients are to be unscaled: those this pass wrote (the rest
        were set aside by begin_pass, or never had one), so the scaler is never handed a
        gradient it dropped or unscaled before."""
        if self.model_params:
            self.backend.grads_to_masters(self.model_params, self.masters)
        return [p for p in self.params() if p.grad is not None]

    def end_pass(self, overflow: bool) -> None:
        if overflow:  # the scaler dropped the new gradients; the step will be skipped
            self.skip_next = True
        elif self.stash is not None:
            self.backend.restore_grads(*self.stash)
        self.stash = None
        self.scaled_by = None


def _amp_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    info: _OptimizerAmp = getattr(optimizer, _OPT_ATTR)
    if info.scaled_by is not None:
        raise RuntimeError(
            f"optimizer.step() was called while its gradients are still scaled by loss"
            f" scale {info.scaled_by}: the last amp.scale_loss() used delay_unscale=True."
            f" End the accumulation with a scale_loss(..., delay_unscale=False) before"
            f" stepping.")
    if kwargs.get("closure") is not None or (args and callable(args[0])):
        raise RuntimeError("A closure in optimizer.step() is not supported after"
                           " amp.initialize() (as in apex): compute the loss, scale_loss it,"
                           " then call step() without one.")
    backend = info.backend
    if info.skip_next:
        info.skip_next = False
        backend.drop_grads(info.params())
        return backend.skipped_step_result(optimizer)
    _stale.refuse(info, "optimizer.step()")
    result = info.inner_step(*args, **kwargs)
    if info.masters:
        backend.copy_params(info.model_params, info.masters)
        # Master gradients live from scale_loss's exit to this step: whichever way the
        # user zeroes gradients (model, GradManager, optimizer), none are left over.
        backend.drop_grads(info.masters)
    return result


def _amp_state_dict(optimizer: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    info: _OptimizerAmp = getattr(optimizer, _OPT_ATTR)
    out = dict(info.inner_state_dict(*args, **kwargs))
    out[MASTER_KEY] = [info.backend.master_copy(m) for m in info.masters]
    return out


def _amp_load_state_dict(optimizer: Any, state_dict: Any, *args: Any, **kwargs: Any
                         ) -> Any:
    info: _OptimizerAmp = getattr(optimizer, _OPT_ATTR)
    state_dict = dict(state_dict)
    saved = state_dict.pop(MASTER_KEY, None)
    if saved is not None and len(saved) != len(info.masters):
        raise ValueError(
            f"optimizer.load_state_dict(): the checkpoint holds {len(saved)} master"
            f" weights, this optimizer {len(info.masters)}; it was saved from a different"
            f" model or opt level.")
    result = info.inner_load_state_dict(state_dict, *args, **kwargs)
    if saved is None:
        # A checkpoint without masters (saved at another opt level): start them from
        # the model's weights, as apex does -- so load the model's state first.
        info.backend.copy_params(info.masters, info.model_params)
    else:
        info.backend.copy_params(info.masters, saved)
        info.backend.copy_params(info.model_params, info.masters)
    return result
