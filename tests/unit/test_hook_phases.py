"""Dispatch order by declared phase: observation, caching, sharding, override, placement around the real
forward. Names only order hooks within one phase."""
from __future__ import annotations

import pytest
import torch

from omni_hooks import HookPhase, HookRegistry, ModelHook
from omni_hooks.caching.hooks import StackTailHook


class EchoModule(torch.nn.Module):
    def forward(self, inp: str) -> str:
        return inp + "ECHO"


def phased(phase: HookPhase, tag: str, override: bool = False) -> ModelHook:
    class Tagged(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return args, {**kwargs, "inp": kwargs["inp"] + tag}

        def post_forward(self, module, output):
            return output + tag.lower()

    Tagged.phase = phase
    if override:
        class Overriding(Tagged):
            def __init__(self, passes_through: bool = False):
                self.passes_through = passes_through

            def new_forward(self, module, *args, **kwargs):
                if self.passes_through:
                    return kwargs["inp"] + "SKIP"
                return self.fn_ref.original_forward(*args, **kwargs)

        return Overriding
    return Tagged()


def test_phase_decides_the_order_whatever_the_names():
    module = EchoModule()
    reg = HookRegistry.get_or_create(module)
    # names chosen so that name order is the reverse of phase order
    reg.register_hook("a_placement", phased(HookPhase.PLACEMENT, "P"))
    reg.register_hook("b_sharding", phased(HookPhase.SHARDING, "S"))
    reg.register_hook("c_caching", phased(HookPhase.CACHING, "C"))
    reg.register_hook("d_observation", phased(HookPhase.OBSERVATION, "O"))
    assert reg.ordered_names() == ["d_observation", "c_caching", "b_sharding", "a_placement"]
    assert module(inp="") == "OCSPECHOpsco"


def test_names_order_hooks_within_one_phase():
    module = EchoModule()
    reg = HookRegistry.get_or_create(module)
    reg.register_hook("b", phased(HookPhase.CACHING, "2"))
    reg.register_hook("a", phased(HookPhase.CACHING, "1"))
    assert module(inp="") == "12ECHO21"


def test_placement_hooks_run_only_when_the_real_forward_runs():
    module = EchoModule()
    reg = HookRegistry.get_or_create(module)
    override = phased(HookPhase.CACHING, "C", override=True)(passes_through=False)
    reg.register_hook("cache", override)
    reg.register_hook("offload", phased(HookPhase.PLACEMENT, "P"))
    reg.register_hook("gather", phased(HookPhase.SHARDING, "S"))
    # computed: the overriding hook's pre_forward last (whatever its phase), placement around the real forward
    assert module(inp="") == "SCPECHOpcs"
    override.passes_through = True
    # passed through: the placement hook sees nothing of the call
    assert module(inp="") == "SCSKIPcs"


def test_placement_only_registry_wraps_the_forward():
    module = EchoModule()
    HookRegistry.get_or_create(module).register_hook("offload", phased(HookPhase.PLACEMENT, "P"))
    assert module(inp="") == "PECHOp"


def test_a_placement_hook_may_not_override_forward_and_nothing_changes():
    module = EchoModule()
    reg = HookRegistry.get_or_create(module)
    bad = phased(HookPhase.PLACEMENT, "P", override=True)()
    with pytest.raises(ValueError, match="placement"):
        reg.register_hook("offload", bad)
    assert reg.ordered_names() == [] and bad.fn_ref is None
    assert module(inp="") == "ECHO"


def test_a_sharding_tail_hook_runs_after_the_cache_tail_regardless_of_names():
    """An SP gather at the tail must see what the cache's tail hook produced (sharded head + residual), never the
    other way round: by name 'sp_output---head' < 'teacache_tail', by phase the cache goes first."""
    seen = []

    class CacheTail(StackTailHook):
        def __init__(self):
            pass

        def pre_forward(self, module, *args, **kwargs):
            seen.append("cache")
            return args, kwargs

    class Gather(ModelHook):
        phase = HookPhase.SHARDING

        def pre_forward(self, module, *args, **kwargs):
            seen.append("gather")
            return args, kwargs

    tail = torch.nn.Linear(2, 2)
    reg = HookRegistry.get_or_create(tail)
    reg.register_hook("sp_output---head", Gather())
    reg.register_hook("teacache_tail", CacheTail())
    tail(torch.zeros(1, 2))
    assert seen == ["cache", "gather"]


def test_phase_must_be_a_hook_phase():
    class Odd(ModelHook):
        phase = 5

    with pytest.raises(TypeError, match="HookPhase"):
        HookRegistry.get_or_create(EchoModule()).register_hook("odd", Odd())


def test_reset_forgets_placement_hooks_and_restores_the_module():
    module = EchoModule()
    reg = HookRegistry.get_or_create(module)
    reg.register_hook("offload", phased(HookPhase.PLACEMENT, "P"))
    reg.reset()
    assert "forward" not in module.__dict__ and module(inp="") == "ECHO"
