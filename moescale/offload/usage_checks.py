"""Two silent mistakes of the offloading loop, turned into errors that name the fix.

1. An optimizer built before `offload_moe`: it still holds the expert parameters that
   offload_moe took out of the model (their values now live in the store), so it steps nothing
   for them and the experts train with the store's own AdamW defaults instead of its
   hyper-parameters. `MovedParameters` remembers the parameters moved out (by weak reference:
   it keeps none alive); `check(optimizer)` raises when an optimizer holds one. The engine
   calls it from `follow(optimizer)` and, for optimizers it is never shown, from a step
   pre-hook on every torch optimizer, installed while the engine lives.
2. A missing `engine.step()`: the last micro-batch's backward ran (its expert gradients are
   in the store, and in eager mode some experts stepped) and the next step's forward starts
   without the engine having stepped the rest. `NOT_STEPPED` is the engine's message.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

NOT_STEPPED = (
    "a forward of a new step started, but the previous step's expert gradients were never "
    "applied: its last micro-batch ran backward and engine.step() was not called; call "
    "engine.step() (or engine.skip_step()) after each step's last backward, before the next "
    "forward; with gradient accumulation, call engine.begin_micro_batch(last=False) before "
    "every micro-batch but the last (the default, last=True, ends the step at its backward)")


class MovedParameters:
    """The expert parameters that offload_moe moved into the store (weakly referenced)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}
        self._hook = None

    def add(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            self._refs[id(p)] = weakref.ref(p)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError when `optimizer` holds a parameter offload_moe moved out."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                ref = self._refs.get(id(p))
                if ref is not None and ref() is p:
                    raise ValueError(
                        f"the optimizer {type(optimizer).__name__} holds expert parameters "
                        f"that offload_moe moved into the expert store (shape "
                        f"{tuple(p.shape)}): it was built before offload_moe, so it would "
                        "never update the experts; build the optimizer after offload_moe, "
                        "from model.parameters() (the dense parameters only, once "
                        "offloaded), then call engine.follow(optimizer)")

    def watch_optimizer_steps(self) -> None:
        """Check every torch optimizer at each step (until close()). The hook holds this
        object weakly, so a forgotten engine does not keep it alive."""
        me = weakref.ref(self)

        def pre_step(optimizer, args, kwargs):
            moved = me()
            if moved is not None:
                moved.check(optimizer)

        self._hook = register_optimizer_step_pre_hook(pre_step)
        weakref.finalize(self, self._hook.remove)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
