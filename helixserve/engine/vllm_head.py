"""Prompt logprobs on a vLLM stage: the torch engine's rule (ShardEngine._score_prompt) over
logits that vLLM's final norm and lm_head compute.

Row j of an item scores the token at position + j + 1; the row before a chunk boundary waits
for the next chunk's first token (`pending_prompt_row`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from helixserve.engine.history import RequestHistory
from helixserve.engine.protocol import WorkItem
from helixserve.engine.sampling import score_tokens
from helixserve.engine.shard import PROMPT_LOGPROBS_ROWS, ShardEngine


def score_prompt_rows(
    it: WorkItem, hist: RequestHistory, logits_of: Callable[[int, int], torch.Tensor]
) -> None:
    """Add the prompt logprobs this item's rows give to `hist.prompt_logprobs`.

    logits_of(a, b): logits [b - a, vocab] of the item's rows a..b-1."""
    assert it.sampling is not None and it.sampling.prompt_logprobs is not None
    top_n = it.sampling.prompt_logprobs
    pos, n = it.position, len(it.token_ids)
    prompt_end = ShardEngine._prompt_end(it, hist)
    pending, hist.pending_prompt_row = hist.pending_prompt_row, None
    if prompt_end is not None and pos >= prompt_end:
        return
    if pending is not None and pending[0] == pos:
        hist.prompt_logprobs += score_tokens(pending[1][None], it.token_ids[:1], top_n)
    rows = n if prompt_end is None or prompt_end > pos + n else prompt_end - pos - 1
    for a in range(0, rows, PROMPT_LOGPROBS_ROWS):
        b = min(rows, a + PROMPT_LOGPROBS_ROWS)
        logprobs = torch.log_softmax(logits_of(a, b).float(), dim=-1)  # [b - a, vocab]
        targets = it.token_ids[a + 1 : b + 1]  # one short at the item's last row
        hist.prompt_logprobs += score_tokens(logprobs[: len(targets)], targets, top_n)
        if len(targets) < b - a:
            hist.pending_prompt_row = (pos + n, logprobs[-1].clone())
