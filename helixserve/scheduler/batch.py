"""Batch formation: what one engine step of a node runs, from the work queued there.

One step (continuous batching, as vLLM's scheduler forms it) takes
- decode items, oldest first, up to `StepBudget.max_decode_seqs` sequences;
- prompt work, oldest first, up to `StepBudget.max_prompt_tokens` tokens:
  - `chunked_prefill`: the head prompt's remaining tokens are cut to what is left of the
    budget; the rest of that prompt waits for the next step, and nothing behind it runs
    (a prompt's chunks run in order);
  - else whole items: a prompt that does not fit in what is left ends the step's prompts;
    the first one always runs, however long (it could never run otherwise).

`plan_step` is pure: it reads the queues and returns a `StepPlan` (what to run and how
many items leave the head of the prompt queue); the caller applies it. The simulator's
nodes (whole prompts per hop, chunked by the budget) and the live workers (items the
coordinator has already cut into chunks, which a worker never splits again: it calls with
`chunked_prefill=False`) both call it. docs/scheduler.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from helixserve.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class StepBudget:
    """What one engine step may take."""

    #: decode sequences per step; None: no cap
    max_decode_seqs: int | None = None
    #: prompt tokens per step beside the decode tokens (vLLM's max_num_batched_tokens);
    #: None: no cap
    max_prompt_tokens: int | None = None
    #: cut a prompt to the budget left (True) or run whole items only (False)
    chunked_prefill: bool = False

    def check(self) -> StepBudget:
        """Raise UserError naming the bad field; return self."""
        if self.max_decode_seqs is not None and self.max_decode_seqs < 1:
            raise UserError(f"max_decode_seqs: must be >= 1, got {self.max_decode_seqs}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise UserError(f"max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens}")
        return self


@dataclass
class StepPlan(Generic[T]):
    """One step: run `decode` and `prompts` (each with the tokens it runs this step)."""

    decode: list[T] = field(default_factory=list)
    #: (item, prompt tokens it runs this step), oldest first
    prompts: list[tuple[T, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    #: items leaving the head of the prompt queue: those run whole (or to their last chunk)
    #: and the dead ones skipped on the way; a partly run prompt stays at the head
    prompts_popped: int = 0

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prompts


def plan_step(
    decode_queue: Sequence[T],
    prompt_queue: Iterable[T],
    budget: StepBudget,
    prompt_left: Callable[[T], int],
    dead: Callable[[T], bool] | None = None,
) -> StepPlan[T]:
    """The next step of a node whose queues hold `decode_queue` (oldest first; the caller
    has dropped dead ones) and `prompt_queue` (oldest first; `dead` items are skipped and
    popped). `prompt_left(item)`: the prompt tokens the item still has to run here."""
    cap = budget.max_decode_seqs
    decode = list(decode_queue) if cap is None or len(decode_queue) <= cap else \
        list(decode_queue[:cap])
    plan: StepPlan[T] = StepPlan(decode=decode)
    limit = budget.max_prompt_tokens
    prompts = plan.prompts
    tokens = popped = 0
    if budget.chunked_prefill:
        room = limit if limit is not None else -1  # -1: unlimited
        for item in prompt_queue:
            if room == 0:
                break
            if dead is not None and dead(item):
                popped += 1
                continue
            left = prompt_left(item)
            take = left if room < 0 or left <= room else room
            prompts.append((item, take))
            tokens += take
            if room > 0:
                room -= take
            if take < left:
                break  # the rest of this prompt in a later step
            popped += 1
    else:
        for item in prompt_queue:
            left = prompt_left(item)
            if prompts and limit is not None and tokens + left > limit:
                break
            popped += 1
            if dead is not None and dead(item):
                continue
            prompts.append((item, left))
            tokens += left
    plan.prompt_tokens, plan.prompts_popped = tokens, popped
    return plan
