"""peft's adapter calls on a wrapped model: the ones that would change it refuse at once,
``disable_adapter()`` works.

[Note: peft adapter calls]
The engine fixes, when it is built, which parameters the model has and which of them train
(their flat parameters, gradients and Adam state). peft switches adapters by setting
``requires_grad`` on the adapters' parameters, which a wrapped model's parameters refuse
(:class:`offload_zero.partition.flat_param.ModelParam`), and it adds, removes or merges
modules, which the engine would not see. Left to themselves, those calls failed half-way:
``load_adapter(path, adapter_name="other")`` injected the new LoRA modules and only then
raised, leaving them in the model. So, while wrapped, each such call is replaced (an instance
attribute on the object that has it, taken off again by ``engine.close()``) by one that raises
``NotImplementedError`` before anything is changed, naming the call and what to do instead:

- on peft's ``PeftModel`` (:data:`PEFT_MODEL_CALLS`) and on its tuner, the ``LoraModel`` that
  ``model.base_model`` is (:data:`TUNER_CALLS`; ``model.merge_and_unload()`` reaches it through
  ``PeftModel.__getattr__``);
- on every transformers model in the tree, transformers' own adapter methods
  (:data:`TRANSFORMERS_CALLS`), which would inject or toggle peft layers the same way.

``load_adapter(path, adapter_name)`` of an adapter the model already has only loads weights
(peft's ``load_state_dict``, which reaches the engine's master weights, as transformers'
Trainer does for the best checkpoint): it is passed to peft.

``disable_adapter()`` (LoRA) is supported: peft's own context sets ``requires_grad=False`` on
the adapters, only so that their gradients are None; what the forward reads is each tuner
layer's ``_disable_adapters`` flag (a disabled LoRA layer computes ``base_layer(x)`` only, a
``modules_to_save`` wrapper its original module). :func:`disable_adapter` sets those flags
alone and restores each one's previous value on exit, so no parameter, flat parameter or
optimizer state changes: the logits are the base model's, and the adapters, unused, get no
gradient (as peft's frozen ones would not). Inside the context the adapters'
``requires_grad`` still reads True. Pending updates (``update_timing="next_forward"``) are
applied on entry, as for any read between steps: a forward with the adapters off skips
their modules, and at stage 3 with the LoRA layers as units of their own the prefetch would
otherwise apply a skipped unit's update into a read-ahead buffer that its gather never frees.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Callable, Dict, List, Tuple

import torch.nn as nn

_ADDS = "adds adapter modules and parameters"
_REMOVES = "removes adapter modules and parameters"
_TRAINS = "sets requires_grad on the adapters' parameters (which of them train)"
_MERGES = "writes the adapters into the frozen base weights"
_UNLOADS = "replaces the adapter layers by the base layers"

_MERGE_HINT = ("to merge a trained adapter, save it with model.save_pretrained(folder) and "
               "call PeftModel.from_pretrained(base, folder).merge_and_unload() on a model "
               "that is not wrapped")

_UNWRAPPED_HINT = "for logits without the adapters keep an unwrapped copy of the base model"

# call -> what it changes
PEFT_MODEL_CALLS: Dict[str, str] = {
    "add_adapter": _ADDS,
    "load_adapter": _ADDS,  # (of a new adapter name; an existing one's weights load)
    "delete_adapter": _REMOVES,
    "set_adapter": _TRAINS,
    "set_requires_grad": _TRAINS,
}
TUNER_CALLS: Dict[str, str] = {
    "add_weighted_adapter": _ADDS,
    "inject_adapter": _ADDS,
    "delete_adapter": _REMOVES,
    "set_adapter": _TRAINS,
    "set_requires_grad": _TRAINS,
    "disable_adapter_layers": _TRAINS,
    "enable_adapter_layers": _TRAINS,
    "merge_adapter": _MERGES,
    "unmerge_adapter": _MERGES,
    "merge_and_unload": _UNLOADS,
    "unload": _UNLOADS,
}
TRANSFORMERS_CALLS: Dict[str, str] = {
    "load_adapter": _ADDS,
    "add_adapter": _ADDS,
    "enable_peft_hotswap": _ADDS,
    "delete_adapter": _REMOVES,
    "set_adapter": _TRAINS,
    "disable_adapters": _TRAINS,
    "enable_adapters": _TRAINS,
}


def refusal(owner: str, call: str, changes: str, hint: str = "") -> NotImplementedError:
    """The error of ``owner``'s (``"peft"``, ``"transformers"``) ``call`` (as written, with
    its parentheses) on a wrapped model: what it would change, that nothing was changed, and
    what to do instead (``hint``, or the one that fits ``changes``)."""
    hint = hint or (_MERGE_HINT if changes in (_MERGES, _UNLOADS) else (
        "for logits without the adapters use `with torch.no_grad(), model.disable_adapter():`"))
    whose = owner + ("'" if owner.endswith("s") else "'s")
    return NotImplementedError(
        f"{whose} {call} on a model wrapped by an OffloadEngine: it {changes}, which the "
        "engine fixed when it was built (the model's parameters, which of them train, their "
        "gradients and Adam state); nothing was changed. Call it before OffloadEngine(model, "
        "...), or on an unwrapped copy of the model (copy.deepcopy(model) before wrapping); "
        f"{hint} (docs/huggingface.md)")


class PeftCalls:
    """The replacements of [Note: peft adapter calls] on one wrapped model.

    Args:
        model: the wrapped model (``engine.module``).
        settle: called with no argument as ``disable_adapter()`` is entered: applies the
            updates the engine left pending (``engine.apply_pending_updates`` while it is open;
            nothing once it is closed).

    Nothing is installed on a model without peft or transformers modules. :meth:`remove`
    takes the replacements off (``engine.close()``)."""

    def __init__(self, model: nn.Module, settle: Callable[[], None]):
        self._settle = settle
        self._installed: List[Tuple[nn.Module, str]] = []
        peft = sys.modules.get("peft")
        transformers = sys.modules.get("transformers")
        for module in model.modules():
            if peft is not None and isinstance(module, peft.PeftModel):
                self._refuse(module, "peft", PEFT_MODEL_CALLS)
                self._install(module, "disable_adapter",
                              lambda m=module: disable_adapter(m, self._settle))
            elif peft is not None and isinstance(module, peft.tuners.tuners_utils.BaseTuner):
                self._refuse(module, "peft", TUNER_CALLS)
            elif transformers is not None and isinstance(module, transformers.PreTrainedModel):
                # (only transformers' peft methods: wav2vec2's load_adapter is its own)
                self._refuse(module, "transformers", TRANSFORMERS_CALLS,
                             only_from=transformers.integrations.peft.PeftAdapterMixin)

    def _refuse(self, module: nn.Module, owner: str, calls: Dict[str, str],
                only_from=None) -> None:
        """Replace each of ``calls`` that ``module``'s class has (from the class ``only_from``,
        when given) by a refusal; peft's ``load_adapter`` and ``set_adapter`` by one that
        passes to peft the cases that change nothing the engine fixed."""
        for call, changes in calls.items():
            own = getattr(type(module), call, None)
            if not callable(own) or (only_from is not None
                                     and own is not getattr(only_from, call, None)):
                continue
            if owner == "peft" and call == "load_adapter":
                self._install(module, call, _load_adapter_of(module))
            elif owner == "peft" and call == "set_adapter":
                self._install(module, call, _set_adapter_of(module))
            else:
                self._install(module, call, _refuser(owner, call, changes))

    def _install(self, module: nn.Module, call: str, function) -> None:
        """Set ``function`` as ``module``'s ``call`` (an instance attribute), to be removed."""
        object.__setattr__(module, call, function)
        self._installed.append((module, call))

    def remove(self) -> None:
        """Give each object its own methods back (idempotent)."""
        for module, call in self._installed:
            module.__dict__.pop(call, None)
        self._installed.clear()


def _refuser(owner: str, call: str, changes: str):
    """A function that raises :func:`refusal` of ``owner``'s ``call`` whatever its arguments."""
    def refuse(*args, **kwargs):
        raise refusal(owner, f"{call}()", changes)
    refuse.__doc__ = f"Raises NotImplementedError: {owner}'s {call}() {changes}."
    return refuse


def _load_adapter_of(peft_model):
    """peft's ``load_adapter`` for an adapter name the model has (it loads the weights only);
    NotImplementedError for a new one (it would add modules), raised before anything is read."""
    own = type(peft_model).load_adapter

    def load_adapter(model_id, adapter_name, *args, **kwargs):
        if adapter_name not in peft_model.peft_config:
            raise refusal("peft", f"load_adapter(..., adapter_name={adapter_name!r})", _ADDS)
        return own(peft_model, model_id, adapter_name, *args, **kwargs)
    load_adapter.__doc__ = own.__doc__
    return load_adapter


def _set_adapter_of(module):
    """peft's ``set_adapter`` (of a ``PeftModel`` or a tuner) for the adapters already active,
    not in inference mode: peft then sets on each adapter parameter the ``requires_grad`` it
    has (a parameter whose value would change raises, the first one met, before any does);
    NotImplementedError, before anything changes, for any other adapter."""
    own = type(module).set_adapter

    def set_adapter(adapter_name, inference_mode: bool = False):
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        active = module.active_adapters
        if inference_mode or names != list(active):
            raise refusal("peft", f"set_adapter({adapter_name!r}"
                          + (", inference_mode=True)" if inference_mode else ")")
                          + f" (active: {active!r})", _TRAINS)
        return own(module, adapter_name, inference_mode=inference_mode)
    set_adapter.__doc__ = own.__doc__
    return set_adapter


@contextlib.contextmanager
def disable_adapter(peft_model, settle: Callable[[], None]):
    """peft's ``with model.disable_adapter():`` on a wrapped model: the forwards inside compute
    the base model alone; on exit each tuner layer is as it was (see [Note: peft adapter
    calls]). NotImplementedError, before anything changes, for an adapter other than LoRA
    or adapters merged into the base weights."""
    config = peft_model.peft_config[peft_model.active_adapter]
    peft_type = getattr(config.peft_type, "value", config.peft_type)
    if peft_type != "LORA":
        raise refusal("peft", "disable_adapter()", f"(for a {peft_type} adapter) " + _TRAINS,
                      hint=_UNWRAPPED_HINT)
    layers = _tuner_layers(peft_model)
    if any(getattr(layer, "merged", False) for layer in layers):
        raise refusal("peft", "disable_adapter()", "(with merged adapters) " + _MERGES,
                      hint=_UNWRAPPED_HINT)
    if any(getattr(peft_model.peft_config[name], "bias", "none") != "none"
           for name in peft_model.active_adapters):
        warnings.warn("disable_adapter() with a LoRA bias other than 'none': the output is not "
                      "the base model's (as with peft on an unwrapped model)")
    settle()
    before = [(layer, layer._disable_adapters) for layer in layers]
    was_disabled = peft_model._adapters_disabled
    try:
        for layer, _ in before:
            layer._disable_adapters = True
        peft_model._adapters_disabled = True
        yield
    finally:
        for layer, flag in before:
            layer._disable_adapters = flag
        peft_model._adapters_disabled = was_disabled


def _tuner_layers(peft_model) -> List[nn.Module]:
    """The modules whose ``_disable_adapters`` flag peft's LoRA forward reads: the tuner layers
    and the ``modules_to_save`` / trainable-token wrappers."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
    return [m for m in peft_model.base_model.model.modules()
            if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
