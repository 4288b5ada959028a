"""What the last stage keeps of one request for sampling: the tokens it has seen (penalties,
min_tokens, a grammar's replay), its own generator (seeded draws) and its grammar's state.
Both the sampler (`engine/sampling.py`) and the grammars (`engine/structured.py`) read it."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from helixserve.request import PromptLogprob, SamplingParams

if TYPE_CHECKING:
    from helixserve.engine.structured import GrammarState


@dataclass
class RequestHistory:
    """What the last stage has seen of one request, for penalties and seeded draws."""

    prompt_ids: set[int] = field(default_factory=set)
    output_counts: Counter[int] = field(default_factory=Counter)
    generator: torch.Generator | None = None
    sampled_once: bool = False
    """After the first sampled token, tokens fed back are generated ones, not prompt."""
    num_generated: int = 0
    """Generated tokens fed back so far (for min_tokens)."""
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    """Prompt logprobs scored so far (prompt_logprobs requests), handed out with the first token."""
    pending_prompt_row: tuple[int, torch.Tensor] | None = None
    """(position, logprobs [vocab]) of a prompt chunk's last row: it scores the token at that
    position, which the next chunk brings."""
    output_ids: list[int] = field(default_factory=list)
    """Generated tokens fed back so far, in order (a grammar replays them)."""
    grammar: GrammarState | None = None
    """Structured requests: the grammar's matcher, built at the first sample here."""

    def add_tokens(self, token_ids: list[int], generated: bool) -> None:
        if generated:
            self.output_counts.update(token_ids)
            self.output_ids += token_ids
            self.num_generated += len(token_ids)
        else:
            self.prompt_ids.update(token_ids)

    def get_generator(self, params: SamplingParams, device: torch.device) -> torch.Generator:
        """The request's own generator (seeded requests draw from it alone)."""
        if self.generator is None:
            seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
        return self.generator


def suppresses_stop(params: SamplingParams, hist: RequestHistory) -> bool:
    """True while the request is below min_tokens and must not sample a stop token."""
    return bool(params.stop_token_ids) and hist.num_generated < params.min_tokens
