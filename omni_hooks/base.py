"""The hook registry: one per torch module, hooks ordered by declared phase, at most one forward override.

Registration validates before it mutates (a refused hook changes nothing), ``HookRegistry.reset()`` restores the
module exactly, and the order comes from each hook class's declared ``HookPhase``, never from the hook names alone
(docs/design.md, "The hook registry").

Dispatch contract (``HookRegistry.dispatch``), from the outside in:
  1. ``pre_forward`` of every hook that is not of the placement phase, by phase (observation, caching, sharding),
     then name; the forward-overriding hook last;
  2. the overriding hook's ``new_forward`` if there is one, else the module's forward (step 3);
  3. the module's forward *as it really runs*: placement-phase hooks' ``pre_forward`` (by name), the original
     forward, their ``post_forward`` in reverse. An override reaches this through ``fn_ref.original_forward``; when
     it passes the module through instead (a cache skipping a block), placement hooks do not run at all, so a
     skipped block moves no weights;
  4. ``post_forward`` in the reverse of step 1's order.
"""
from __future__ import annotations

import enum
import functools
import inspect
from typing import Any, Callable, ClassVar

import torch

REGISTRY_ATTR = "_hook_registry"
ORIGINAL_FORWARD_ATTR = "_omni_original_forward"
# Set when the module already had an instance-level ``forward`` before we wrapped it, so reset() puts it back.
INSTANCE_FORWARD_ATTR = "_omni_instance_forward"


class HookPhase(enum.IntEnum):
    """Where a hook sits in dispatch, outermost first. Hooks of one phase run in name order among themselves.

    * ``OBSERVATION``: sees the call as the caller made it and the output the caller gets (timers, statistics).
      A sequence-parallel split declared ``outside_caches`` also runs here, so the caches of a stack whose first
      block is the split point see this rank's shard.
    * ``CACHING``: caches; sees the model's own tensors (on a sequence-parallel rank: its shard, since splits happen
      at module inputs and gathers at module outputs, inside this phase). A cache's tail ``pre_forward`` therefore
      runs before a sharding hook's gather on the same module.
    * ``SHARDING``: sequence-parallel split/gather of a module's inputs and outputs; nearest to the forward among
      the hooks that transform arguments.
    * ``PLACEMENT``: weight placement (offload). Runs only around the module's real forward (see the module
      docstring), never on a call whose forward a cache passes through. A placement hook may not override forward.
    """

    OBSERVATION = 0
    CACHING = 1
    SHARDING = 2
    PLACEMENT = 3


class BaseState:
    """A container of per-context hook state. ``reset()`` returns it to its initial values."""

    def reset(self) -> None:
        pass


class StateManager:
    """One state object per context name ("cond", "uncond", ...), made by ``state_cls()`` on first use.

    A falsy context name means ``"default"``. ``get_state()`` never raises.
    """

    DEFAULT_CONTEXT = "default"

    def __init__(self, state_cls: type[BaseState]):
        self._state_cls = state_cls
        self._states: dict[str, BaseState] = {}
        self._context = self.DEFAULT_CONTEXT

    def set_context(self, name: str | None) -> None:
        """Make ``name`` (falsy: "default") the context ``get_state`` answers for."""
        self._context = name or self.DEFAULT_CONTEXT

    def get_state(self) -> BaseState:
        """The current context's state, made now if it has none."""
        state = self._states.get(self._context)
        if state is None:
            state = self._state_cls()
            self._states[self._context] = state
        return state

    def contexts(self) -> list[str]:
        """Names of the contexts that currently hold a state."""
        return list(self._states)

    def reset(self) -> None:
        """Reset every state, forget them all, and return to the default context."""
        for state in self._states.values():
            state.reset()
        self._states.clear()
        self._context = self.DEFAULT_CONTEXT


class _ForwardRef:
    """What a hook's ``fn_ref`` points at: the module's forward as it really runs (placement hooks around the
    original, unhooked forward; just the original when the module has no placement hook)."""

    def __init__(self, module: torch.nn.Module):
        self._module = module

    @property
    def original_forward(self) -> Callable[..., Any]:
        registry = self._module.__dict__.get(REGISTRY_ATTR)
        if registry is not None and registry._placement_hooks:
            return registry.run_forward
        return getattr(self._module, ORIGINAL_FORWARD_ATTR)


class ModelHook:
    """A hook on one module's forward.

    ``pre_forward`` may rewrite the call's arguments, ``post_forward`` the output. A hook *overrides forward* iff its
    class defines ``new_forward``; the registry then calls it with the arguments after every ``pre_forward``
    (its own included) in place of the module's forward, and still calls its ``post_forward`` itself; so a
    ``new_forward`` must never call its own pre/post. The forward it may run is ``self.fn_ref.original_forward``.

    ``phase`` (a class attribute) places the hook in dispatch; see ``HookPhase``.
    """

    phase: ClassVar[HookPhase] = HookPhase.OBSERVATION
    fn_ref: _ForwardRef | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """Called once, by ``register_hook``, before the hook is stored."""
        return module

    def deinitialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """Called when the hook is removed from the module."""
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("By default, hooks do not implement new_forward")

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        """Clear per-generation state."""
        return module


def overrides_forward(hook: ModelHook) -> bool:
    return type(hook).new_forward is not ModelHook.new_forward


def sort_hooks_after_call(method: Callable) -> Callable:
    """Run a registry method that adds or removes hooks, then re-sort the hooks (only if it returned normally)."""

    @functools.wraps(method)
    def wrapper(self: "HookRegistry", *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        self.update_sorted_hooks()
        return result

    return wrapper


class _WrappedForward:
    """Installed as the instance attribute ``module.forward``; sends calls through the module's registry."""

    def __init__(self, module: torch.nn.Module, original: Callable[..., Any]):
        self._module = module
        self.__signature__ = inspect.signature(original)
        self.__wrapped__ = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        registry = self._module.__dict__.get(REGISTRY_ATTR)
        if registry is None or not registry._hooks:
            return getattr(self._module, ORIGINAL_FORWARD_ATTR)(*args, **kwargs)
        return registry.dispatch(*args, **kwargs)


class HookRegistry:
    """The hooks of one module. Create with ``HookRegistry.get_or_create(module)``."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._hooks: dict[str, ModelHook] = {}
        self._sorted_hooks: list[ModelHook] = []
        self._placement_hooks: list[ModelHook] = []
        self._new_fwd_impl_hook: ModelHook | None = None
        self._new_fwd_impl_name: str | None = None

    # -- construction -------------------------------------------------------------------------------------------

    @classmethod
    def get_or_create(cls, module: torch.nn.Module) -> "HookRegistry":
        """The module's registry, creating it (and wrapping ``module.forward``) on first use."""
        registry = module.__dict__.get(REGISTRY_ATTR)
        if registry is not None:
            return registry
        registry = cls(module)
        if ORIGINAL_FORWARD_ATTR not in module.__dict__:
            if "forward" in module.__dict__:
                module.__dict__[INSTANCE_FORWARD_ATTR] = module.__dict__["forward"]
            original = module.forward
            module.__dict__[ORIGINAL_FORWARD_ATTR] = original
            module.__dict__["forward"] = _WrappedForward(module, original)
        module.__dict__[REGISTRY_ATTR] = registry
        return registry

    # -- mutation -----------------------------------------------------------------------------------------------

    @sort_hooks_after_call
    def register_hook(self, name: str, hook: ModelHook, *, replace: bool = False) -> str:
        """Register ``hook`` under ``name``; returns ``name``.

        Raises ValueError for an empty name or one already registered (unless ``replace``), TypeError for a
        non-hook, and RuntimeError, naming both hooks, when ``hook`` overrides forward and another hook on this
        module already does. Any error leaves the registry exactly as it was: the hook is not stored and
        ``initialize_hook`` is not called.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"A hook needs a non-empty string name, got {name!r}")
        if not isinstance(hook, ModelHook):
            raise TypeError(f"Expected a ModelHook for {name!r}, got {type(hook).__name__}")
        replacing = name in self._hooks
        if replacing and not replace:
            raise ValueError(f"A hook named {name!r} is already registered on {type(self.module).__name__}")
        if not isinstance(hook.phase, HookPhase):
            raise TypeError(f"{type(hook).__name__}.phase must be a HookPhase, got {hook.phase!r}")
        if hook.phase is HookPhase.PLACEMENT and overrides_forward(hook):
            raise ValueError(f"{type(hook).__name__} ({name!r}) is a placement-phase hook and overrides forward; "
                             "placement hooks may only use pre_forward/post_forward")
        if overrides_forward(hook) and self._new_fwd_impl_hook is not None and self._new_fwd_impl_name != name:
            raise RuntimeError(
                f"Cannot have multiple hooks that override forward active simultaneously on "
                f"{type(self.module).__name__}: {self._new_fwd_impl_name!r} ({type(self._new_fwd_impl_hook).__name__}) "
                f"is registered, {name!r} ({type(hook).__name__}) cannot be added"
            )
        if replacing:
            self._remove(name)
        self.module = hook.initialize_hook(self.module) or self.module
        hook.fn_ref = _ForwardRef(self.module)
        self._hooks[name] = hook
        if overrides_forward(hook):
            self._new_fwd_impl_hook = hook
            self._new_fwd_impl_name = name
        return name

    @sort_hooks_after_call
    def remove_hook(self, name: str) -> None:
        """Remove a hook by name (unknown names are ignored). The forward wrapper stays; ``reset()`` removes it."""
        self._remove(name)

    def _remove(self, name: str) -> None:
        hook = self._hooks.pop(name, None)
        if hook is None:
            return
        if hook is self._new_fwd_impl_hook:
            self._new_fwd_impl_hook = None
            self._new_fwd_impl_name = None
        hook.deinitialize_hook(self.module)

    def update_sorted_hooks(self) -> None:
        """Order hooks by (phase, name), names in code-point order; the forward-overriding hook last; placement
        hooks apart (they run around the real forward only)."""
        ordered = sorted(self._hooks.items(), key=lambda item: (item[1].phase, item[0]))
        self._sorted_hooks = [hook for name, hook in ordered
                              if hook is not self._new_fwd_impl_hook and hook.phase is not HookPhase.PLACEMENT]
        if self._new_fwd_impl_hook is not None:
            self._sorted_hooks.append(self._new_fwd_impl_hook)
        self._placement_hooks = [hook for name, hook in ordered if hook.phase is HookPhase.PLACEMENT]

    def ordered_names(self) -> list[str]:
        """Hook names in dispatch order (outermost first; placement hooks last, as they wrap the real forward)."""
        by_hook = {id(h): n for n, h in self._hooks.items()}
        return [by_hook[id(h)] for h in self._sorted_hooks + self._placement_hooks]

    def get_hook(self, name: str) -> ModelHook | None:
        """The hook registered under ``name``, or None."""
        return self._hooks.get(name)

    def reset(self) -> None:
        """Reset and remove every hook and restore the module exactly: its forward, signature, no attribute of ours.

        Idempotent; after it, ``HookRegistry.get_or_create(module)`` starts afresh.
        """
        for name in list(self._hooks):
            self._hooks[name].reset_state(self.module)
            self._remove(name)
        self._sorted_hooks = []
        self._placement_hooks = []
        module_dict = self.module.__dict__
        if module_dict.get(REGISTRY_ATTR) is self:
            del module_dict[REGISTRY_ATTR]
            module_dict.pop(ORIGINAL_FORWARD_ATTR, None)
            module_dict.pop("forward", None)
            if INSTANCE_FORWARD_ATTR in module_dict:
                module_dict["forward"] = module_dict.pop(INSTANCE_FORWARD_ATTR)

    # -- calling ------------------------------------------------------------------------------------------------

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """Run a forward call through the hooks (see the module docstring for the order)."""
        hooks = self._sorted_hooks
        if not hooks:
            return self.run_forward(*args, **kwargs)
        module = self.module
        for hook in hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
            args = tuple(args)
        override = self._new_fwd_impl_hook
        if override is not None:
            output = override.new_forward(module, *args, **kwargs)
        else:
            output = self.run_forward(*args, **kwargs)
        for hook in reversed(hooks):
            output = hook.post_forward(module, output)
        return output

    def run_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's real forward: placement hooks' pre_forward, the original forward, their post_forward."""
        original = getattr(self.module, ORIGINAL_FORWARD_ATTR)
        placement = self._placement_hooks
        if not placement:
            return original(*args, **kwargs)
        module = self.module
        for hook in placement:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
            args = tuple(args)
        output = original(*args, **kwargs)
        for hook in reversed(placement):
            output = hook.post_forward(module, output)
        return output

    def __repr__(self) -> str:
        names = [n + (" (forward)" if n == self._new_fwd_impl_name else "") for n in self.ordered_names()]
        return f"HookRegistry({type(self.module).__name__}: {', '.join(names) or 'no hooks'})"


def module_has_active_hooks(module: torch.nn.Module) -> bool:
    """True iff the module has a registry holding at least one hook."""
    registry = module.__dict__.get(REGISTRY_ATTR)
    return registry is not None and bool(registry._hooks)


def remove_hook_and_restore(module: torch.nn.Module, name: str) -> None:
    """Remove the hook ``name`` from ``module``; a module left without hooks is restored exactly (``reset()``)."""
    registry = module.__dict__.get(REGISTRY_ATTR)
    if registry is None:
        return
    registry.remove_hook(name)
    if not registry._hooks:
        registry.reset()
