"""The registry contract (docs/design.md, "The hook registry"), one test per rule, plus the vllm-omni PR #2689 suite
re-stated."""
from __future__ import annotations

import inspect

import pytest
import torch

from omni_hooks import BaseState, HookRegistry, ModelHook, StateManager, module_has_active_hooks


class EchoModule(torch.nn.Module):
    def forward(self, inp: str) -> str:
        return inp + "ECHO"


class AppendHook(ModelHook):
    def __init__(self, value: str):
        self.value = value

    def pre_forward(self, module, *args, **kwargs):
        kwargs["inp"] = kwargs["inp"] + self.value
        return args, kwargs

    def post_forward(self, module, output):
        return output + self.value


class OverrideAppendHook(AppendHook):
    def new_forward(self, module, *args, **kwargs):
        return kwargs["inp"] + "OVERRIDE"


class RecordingHook(ModelHook):
    def __init__(self):
        self.initialized = 0
        self.deinitialized = 0
        self.resets = 0

    def initialize_hook(self, module):
        self.initialized += 1
        return module

    def deinitialize_hook(self, module):
        self.deinitialized += 1
        return module

    def reset_state(self, module):
        self.resets += 1
        return module


class RecordingOverride(RecordingHook):
    def new_forward(self, module, *args, **kwargs):
        return "override"


def registry_for(module=None):
    module = module or EchoModule()
    return module, HookRegistry.get_or_create(module)


# -- ordering and dispatch ---------------------------------------------------------------------------------------

def test_pre_in_name_order_override_last_post_in_reverse():
    module, reg = registry_for()
    reg.register_hook("c", AppendHook("2"))
    reg.register_hook("b", OverrideAppendHook("3"))
    reg.register_hook("a", AppendHook("1"))
    assert [type(h) for h in reg._sorted_hooks] == [AppendHook, AppendHook, OverrideAppendHook]
    assert module(inp="") == "123OVERRIDE321"


def test_without_override_original_forward_runs_between_pre_and_post():
    module, reg = registry_for()
    reg.register_hook("2", AppendHook("2"))
    reg.register_hook("1", AppendHook("1"))
    assert reg._new_fwd_impl_hook is None
    assert module(inp="") == "12ECHO21"


def test_order_is_by_name_not_registration_and_uses_code_point_order():
    module, reg = registry_for()
    for name in ["b", "A", "a", "1"]:
        reg.register_hook(name, AppendHook(name))
    assert module(inp="") == "1AabECHObaA1"


def test_override_is_detected_by_class_defining_new_forward():
    assert ModelHook.new_forward is not OverrideAppendHook.new_forward
    with pytest.raises(NotImplementedError):
        ModelHook().new_forward(EchoModule(), inp="")
    module, reg = registry_for()
    reg.register_hook("x", AppendHook("1"))
    assert reg._new_fwd_impl_hook is None


def test_calls_through_module_and_module_forward_both_dispatch():
    module, reg = registry_for()
    reg.register_hook("a", AppendHook("1"))
    assert module(inp="") == "1ECHO1"
    assert module.forward(inp="") == "1ECHO1"


def test_torch_forward_hooks_still_wrap_the_whole_dispatch():
    module, reg = registry_for()
    reg.register_hook("a", AppendHook("1"))
    module.register_forward_hook(lambda m, args, kwargs, out: out + "T", with_kwargs=True)
    assert module(inp="") == "1ECHO1T"


def test_hooks_on_nested_modules():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = EchoModule()

        def forward(self, inp):
            return "<" + self.inner(inp=inp) + ">"

    outer = Outer()
    HookRegistry.get_or_create(outer).register_hook("o", AppendHook("o"))
    HookRegistry.get_or_create(outer.inner).register_hook("i", OverrideAppendHook("i"))
    assert outer(inp="") == "<oiOVERRIDEi>o"


def test_reentrant_call_does_not_corrupt_order_or_state():
    class Recursive(torch.nn.Module):
        def forward(self, inp, depth=0):
            return inp + "E" if depth == 0 else self(inp=inp + "(", depth=depth - 1) + ")"

    module = Recursive()
    reg = HookRegistry.get_or_create(module)
    reg.register_hook("b", AppendHook("b"))
    reg.register_hook("a", AppendHook("a"))
    # each level: pre a,b then recurse, then post b,a
    assert module(inp="", depth=1) == "ab(abEba)ba"
    assert module(inp="", depth=0) == "abEba"


def test_hook_removed_during_dispatch_does_not_disturb_the_running_call():
    module, reg = registry_for()

    class SelfRemoving(AppendHook):
        def pre_forward(self, m, *args, **kwargs):
            reg.remove_hook("z")
            return super().pre_forward(m, *args, **kwargs)

    reg.register_hook("a", SelfRemoving("1"))
    reg.register_hook("z", AppendHook("9"))
    assert module(inp="") == "19ECHO91"
    assert module(inp="") == "1ECHO1"


def test_pre_forward_may_return_any_iterable_of_args():
    class GenArgs(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return (a + "g" for a in args), kwargs

    module, reg = registry_for()
    reg.register_hook("g", GenArgs())
    assert module("x") == "xgECHO"


def test_fn_ref_gives_the_original_forward():
    class CallsOriginal(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            return "[" + self.fn_ref.original_forward(*args, **kwargs) + "]"

    module, reg = registry_for()
    reg.register_hook("x", CallsOriginal())
    assert module(inp="") == "[ECHO]"


# -- registration errors -----------------------------------------------------------------------------------------

def test_second_override_raises_naming_both_and_changes_nothing():
    module, reg = registry_for()
    first = RecordingOverride()
    reg.register_hook("teacache", first)
    second = RecordingOverride()
    before = (dict(reg._hooks), list(reg._sorted_hooks))
    with pytest.raises(RuntimeError) as err:
        reg.register_hook("magcache", second)
    assert "teacache" in str(err.value) and "magcache" in str(err.value)
    assert (dict(reg._hooks), list(reg._sorted_hooks)) == before
    assert reg._new_fwd_impl_hook is first
    assert second.initialized == 0 and second.fn_ref is None
    assert module(inp="") == "override"


def test_duplicate_name_raises_value_error_and_changes_nothing():
    module, reg = registry_for()
    original = AppendHook("1")
    reg.register_hook("a", original)
    duplicate = RecordingHook()
    with pytest.raises(ValueError):
        reg.register_hook("a", duplicate)
    assert reg.get_hook("a") is original and duplicate.initialized == 0
    assert module(inp="") == "1ECHO1"


def test_replace_of_the_override_leaves_no_stale_override():
    module, reg = registry_for()
    old = RecordingOverride()
    reg.register_hook("x", old)
    reg.register_hook("x", AppendHook("1"), replace=True)
    assert reg._new_fwd_impl_hook is None
    assert old.deinitialized == 1
    assert module(inp="") == "1ECHO1"


def test_initialize_hook_called_once_before_storing():
    seen = []

    class Checking(RecordingHook):
        def initialize_hook(self, module):
            seen.append(self in reg._hooks.values())
            return super().initialize_hook(module)

    module, reg = registry_for()
    hook = Checking()
    reg.register_hook("c", hook)
    assert seen == [False] and hook.initialized == 1


# -- removal and reset -------------------------------------------------------------------------------------------

def test_remove_of_the_override_frees_its_slot():
    module, reg = registry_for()
    reg.register_hook("a", AppendHook("1"))
    reg.register_hook("c", OverrideAppendHook("3"))
    reg._sorted_hooks.reverse()  # corrupt the order: remove_hook must rebuild it
    reg.remove_hook("c")
    assert reg._new_fwd_impl_hook is None
    assert [reg.get_hook("a")] == reg._sorted_hooks
    reg.register_hook("d", OverrideAppendHook("4"))  # the slot is free again
    assert module(inp="") == "14OVERRIDE41"


def test_remove_unknown_name_is_ignored():
    _, reg = registry_for()
    reg.remove_hook("nope")


def test_reset_resets_state_removes_hooks_and_restores_module_exactly():
    module = EchoModule()
    class_forward = type(module).forward
    signature = inspect.signature(module.forward)
    attrs_before = set(module.__dict__)
    reg = HookRegistry.get_or_create(module)
    hooks = [RecordingHook(), RecordingOverride()]
    reg.register_hook("a", hooks[0])
    reg.register_hook("b", hooks[1])
    reg.reset()
    assert [h.resets for h in hooks] == [1, 1]
    assert [h.deinitialized for h in hooks] == [1, 1]
    assert set(module.__dict__) == attrs_before
    assert "forward" not in module.__dict__
    assert module.forward.__func__ is class_forward
    assert inspect.signature(module.forward) == signature
    assert not module_has_active_hooks(module)
    assert module(inp="") == "ECHO"
    reg.reset()  # idempotent
    assert HookRegistry.get_or_create(module) is not reg


def test_reset_restores_a_pre_existing_instance_forward():
    module = EchoModule()
    custom = lambda inp: inp + "CUSTOM"  # noqa: E731
    module.forward = custom
    reg = HookRegistry.get_or_create(module)
    reg.register_hook("a", AppendHook("1"))
    assert module(inp="") == "1CUSTOM1"
    reg.reset()
    assert module.__dict__["forward"] is custom
    assert set(module.__dict__) - set(EchoModule().__dict__) == {"forward"}


def test_wrapped_forward_keeps_the_signature():
    class Sig(torch.nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 2.0, *, shift: int = 0) -> torch.Tensor:
            return x * scale + shift

    module = Sig()
    before = inspect.signature(module.forward)
    HookRegistry.get_or_create(module).register_hook("a", ModelHook())
    assert inspect.signature(module.forward) == before
    assert module(torch.ones(1), 3.0, shift=1).item() == 4.0


def test_registry_is_created_once_per_module():
    module = EchoModule()
    assert HookRegistry.get_or_create(module) is HookRegistry.get_or_create(module)


def test_empty_registry_passes_through():
    module, reg = registry_for()
    reg.register_hook("a", AppendHook("1"))
    reg.remove_hook("a")
    assert module(inp="") == "ECHO"
    assert not module_has_active_hooks(module)


def test_parameters_and_state_dict_unaffected():
    linear = torch.nn.Linear(3, 3)
    keys = list(linear.state_dict())
    x = torch.randn(2, 3)
    expected = linear(x)
    HookRegistry.get_or_create(linear).register_hook("a", ModelHook())
    assert list(linear.state_dict()) == keys
    assert torch.equal(linear(x), expected)


# -- state manager -----------------------------------------------------------------------------------------------

class Counter(BaseState):
    def __init__(self):
        self.count = 5
        self.resets = 0

    def reset(self):
        self.count = 5
        self.resets += 1


def test_state_manager_one_state_per_context_created_on_first_use():
    manager = StateManager(Counter)
    assert manager.contexts() == []
    manager.set_context("cond")
    manager.get_state().count += 1
    manager.set_context("uncond")
    assert manager.get_state().count == 5
    manager.set_context("cond")
    assert manager.get_state().count == 6
    assert sorted(manager.contexts()) == ["cond", "uncond"]


def test_state_manager_default_context_and_reset():
    manager = StateManager(Counter)
    manager.set_context(None)
    default_state = manager.get_state()
    manager.set_context("default")
    assert manager.get_state() is default_state
    manager.set_context("cond")
    cond_state = manager.get_state()
    manager.reset()
    assert default_state.resets == 1 and cond_state.resets == 1
    assert manager.contexts() == []
    assert manager.get_state() is not default_state


def test_base_state_reset_is_a_no_op():
    BaseState().reset()
