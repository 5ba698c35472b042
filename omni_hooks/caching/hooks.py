"""The hooks a ``StackCacheRun`` (``run.py``) registers on its block stack (``StackCacheRun.install``): the head
block's, which asks the policy and runs or passes through the stack; every other block's, which passes through on a
skip; the tail's, which adds the cached residual on a skip and stores a computed one; and the capture module's. All of
the caching phase: a placement hook (offload) on a block runs only when that block really computes. Outside a call
every hook passes through. They reach their run through ``StackRun``, its public face, and import nothing of it.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from ..base import HookPhase, ModelHook, StateManager
from ..blockstack import BlockStack, ReturnedHidden
from .state import ActiveCall


class StackRun(Protocol):
    """What the hooks ask of their run (``StackCacheRun``): the call in progress (None outside a call, when every
    hook passes through), the stack, the verdict at the head, and the residual to add (a skip) or to keep (a
    compute) at the tail."""

    stack: BlockStack
    states: StateManager

    @property
    def active_call(self) -> ActiveCall | None: ...

    def decide(self, head: torch.nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor) -> bool: ...

    def reused_hidden(self, head_input: torch.Tensor) -> torch.Tensor: ...

    def store_residual(self, head_input: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None: ...


class StackHeadHook(ModelHook):
    """On the head block: ask the policy, then run the block or pass its inputs through."""

    phase = HookPhase.CACHING

    def __init__(self, run: StackRun):
        self.run = run

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = self.run
        call = run.active_call
        if call is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        stack = run.stack
        hidden = stack.head_hidden.get(args, kwargs)
        compute = run.decide(module, args, kwargs, hidden)
        call.head_input = hidden.clone() if stack.clone_head_input else hidden
        if compute:
            return self.fn_ref.original_forward(*args, **kwargs)
        return stack.skip_block(module, args, kwargs)

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.run.states.reset()
        return module


class StackBlockHook(ModelHook):
    """On every other block: pass the inputs through while the current call is skipping."""

    phase = HookPhase.CACHING

    def __init__(self, run: StackRun):
        self.run = run

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.run.active_call
        if call is not None and call.skipping:
            return self.run.stack.skip_block(module, args, kwargs)
        return self.fn_ref.original_forward(*args, **kwargs)


class StackTailHook(ModelHook):
    """On the module after the stack: store the residual after a computed call (its input then carries the skip
    correction, if any: ``StackCacheRun.store_residual``), add it after a skipped one.

    A stack of packed streams has one tail per stream (``part`` of ``parts``, called in that order): each gets its
    stream's share of the reused hidden on a skip; on a compute the last one stores the residual of all of them.
    A stack whose ``tail_hidden`` is ``ReturnedHidden`` has its last block as tail: the hook acts on that block's
    output instead of its input.
    """

    phase = HookPhase.CACHING
    #: the tail's hidden is what it returns (``ReturnedHidden``): the hook acts in ``post_forward``
    on_output = False

    def __init__(self, run: StackRun, part: int = 0, parts: int = 1):
        self.run = run
        self.part = part
        self.parts = parts
        self.on_output = isinstance(run.stack.tails()[part][1], ReturnedHidden)

    @property
    def last(self) -> bool:
        return self.part == self.parts - 1

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        run = self.run
        call = run.active_call
        if call is None or call.head_input is None or call.tail_part != self.part:
            return args, kwargs
        if self.on_output:
            return args, kwargs
        where = run.stack.tails()[self.part][1]
        if self.parts == 1:
            head_input, call.head_input = call.head_input, None
            if call.skipping:
                return where.replace(args, kwargs, run.reused_hidden(head_input))
            corrected = run.store_residual(head_input, where.get(args, kwargs))
            return (args, kwargs) if corrected is None else where.replace(args, kwargs, corrected)
        stream = where.get(args, kwargs)
        call.tail_part += 1
        if call.skipping:
            if call.reused is None:
                call.reused = run.reused_hidden(call.head_input)
            width = stream.numel() // max(stream.shape[0], 1)
            share = call.reused[:, call.reused_offset:call.reused_offset + width]
            call.reused_offset += width
            args, kwargs = where.replace(args, kwargs, share.reshape(stream.shape))
        else:
            call.tail_outputs.append(stream.reshape(stream.shape[0], -1))
        if self.last:
            if not call.skipping:  # several streams: never corrected (``StackCacheRun.correcting``)
                run.store_residual(call.head_input, torch.cat(call.tail_outputs, dim=1))
            call.head_input, call.reused, call.tail_outputs = None, None, []
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        if not self.on_output:
            return output
        run = self.run
        call = run.active_call
        if call is None or call.head_input is None:
            return output
        head_input, call.head_input = call.head_input, None
        if call.skipping:
            return run.reused_hidden(head_input)
        corrected = run.store_residual(head_input, output)
        return output if corrected is None else corrected


class StackCaptureHook(ModelHook):
    """On a module the model calls before the head block: remember its first input for the policy."""

    phase = HookPhase.CACHING

    def __init__(self, run: StackRun):
        self.run = run

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        call = self.run.active_call
        if call is not None and args:
            call.captured = args[0]
        return args, kwargs
