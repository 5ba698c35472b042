"""Host-test helpers of CPU Offload: ``Probe`` (test-only wrappers on a MODEL clone that keep the run's sessions, look
inside its calls, and can interrupt a run or emulate ComfyUI's partial load) and the checks that every weight is back
as it was and no hook is left."""
from __future__ import annotations

import torch


class Probe:
    """Test-only wrappers on a MODEL clone: keep the run's sessions, look at the model inside its calls, and
    optionally fail or emulate ComfyUI's partial (lowvram) load, all inside our lifecycle's wrappers."""

    def __init__(self, env, model, interrupt_at_call=None, lowvram_bytes=None):
        """``env`` gives the lifecycle module (``env.lifecycle``) and the node module (``env.node``)."""
        import comfy.model_management
        import comfy.patcher_extension as pe

        self.sessions = []
        self.calls = 0
        self.loaded_weight_memory = []   # ComfyUI's number, seen inside each call
        self.cast_mode_in_offloaded = []  # per call: a layer of the last block in ComfyUI's cast mode with a LoRA
        self.model = model.clone()

        def keep_sessions(executor, *args, **kwargs):
            run = executor.class_obj.model_options["transformer_options"].get(env.lifecycle.RUN_KEY)
            self.sessions = list(run.sessions) if run is not None else []
            return executor(*args, **kwargs)

        def partial_load(executor, patcher, *args, **kwargs):
            loaded = executor(patcher, *args, **kwargs)
            patcher.partially_unload(patcher.offload_device, memory_to_free=lowvram_bytes)
            return loaded

        def look(executor, *args, **kwargs):
            dm = executor.class_obj
            self.loaded_weight_memory.append(self.model.model.model_loaded_weight_memory)
            last_block = dm.blocks[-1] if hasattr(dm, "blocks") else torch.nn.Module()  # Wan's; other families: none
            self.cast_mode_in_offloaded.append(any(
                getattr(m, "comfy_cast_weights", False) and len(getattr(m, "weight_function", [])) > 0
                for m in last_block.modules()))
            self.calls += 1
            if interrupt_at_call is not None and self.calls > interrupt_at_call:
                raise comfy.model_management.InterruptProcessingException()
            return executor(*args, **kwargs)

        self.model.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "test.keep", keep_sessions)
        if lowvram_bytes is not None:
            self.model.add_wrapper_with_key(pe.WrappersMP.PREPARE_SAMPLING, "test.partial", partial_load)
        self.model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test.look", look)

    def session(self, env):
        (session,) = [s for s in self.sessions if s.feature.kind == env.node.KIND]
        return session


def weights_state(dm: torch.nn.Module) -> dict:
    """Every tensor of the model: the object, where it lives and what it holds."""
    state = {}
    for name, t in [*dm.named_parameters(), *dm.named_buffers()]:
        state[name] = (id(t), t.device, t.dtype, tuple(t.shape), t.stride(), t.data_ptr(), t.detach().clone())
    return state


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name, (ident, device, dtype, shape, stride, _, values) in before.items():
        got = after[name]
        assert (got[0], got[1], got[2], got[3], got[4]) == (ident, device, dtype, shape, stride), name
        assert torch.equal(got[6], values), name


def assert_unhooked(dm: torch.nn.Module) -> None:
    for name, m in dm.named_modules():
        assert "_hook_registry" not in m.__dict__ and "forward" not in m.__dict__, name


def block_bytes(block: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in block.parameters()) + \
        sum(b.numel() * b.element_size() for b in block.buffers())
