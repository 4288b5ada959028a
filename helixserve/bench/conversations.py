"""Multi-turn chat conversations for the prefix-caching benchmark (benchmarks/multiturn.py).

Every conversation opens with one system prompt shared by all of them, then sends 4-8 user
turns; each turn's request carries the whole history so far: the system prompt, every earlier
user message and the assistant's actual replies, then the new user message. That is what chat
clients send, and what prefix caching is for: the system prompt is a prefix of every request,
a conversation's history a prefix of its next turn.

The text is generated from a seed, not downloaded: sentences of short English words that are
one token each in SmolLM2/Llama/GPT-2-style vocabularies (helixserve.bench.datasets' words),
ended by a period (one more token). So a text built for n tokens is about n tokens to the
demo model; the server's `usage.prompt_tokens` is the authoritative count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from helixserve.bench.datasets import _WORDS
from helixserve.errors import UserError

#: the opening sentence of the shared system prompt (its remaining tokens are generated)
SYSTEM_OPENING = "You are a helpful assistant. Follow these instructions in every answer."


def make_text(num_tokens: int, rng: random.Random) -> str:
    """About `num_tokens` tokens of sentences (4-14 words and a period each, a paragraph
    break every few sentences): varied text whose length is predictable in tokens."""
    parts: list[str] = []
    tokens = 0
    sentences = 0
    while tokens < num_tokens:
        n = min(rng.randint(4, 14), max(1, num_tokens - tokens - 1))
        words = [rng.choice(_WORDS) for _ in range(n)]
        brk = bool(parts) and sentences % 5 == 0
        parts.append(("\n\n" if brk else " " if parts else "") + " ".join(words) + ".")
        tokens += n + 1 + brk  # the words, the period, the paragraph break
        sentences += 1
    return "".join(parts)


@dataclass(frozen=True)
class Conversation:
    """One conversation's fixed content: the user turns. The assistant's replies come from the
    server at run time, so the requests are built by `messages_for_turn`."""

    index: int
    system_prompt: str
    user_turns: tuple[str, ...]
    #: seconds the user waits before sending each turn (turn 0's: when the conversation
    #: starts); empty: none, every turn is sent as soon as the previous reply ends
    think_s: tuple[float, ...] = ()

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)


def messages_for_turn(conv: Conversation, turn: int, replies: list[str]) -> list[dict[str, str]]:
    """The messages of request `turn` (0-based): system prompt, then for every earlier turn
    its user message and the assistant's reply to it, then this turn's user message.
    `replies` holds at least the replies to turns [0, turn)."""
    if not 0 <= turn < conv.num_turns:
        raise ValueError(f"turn {turn}: conversation {conv.index} has {conv.num_turns} turns")
    if len(replies) < turn:
        raise ValueError(f"turn {turn}: needs the {turn} earlier replies, got {len(replies)}")
    messages = [{"role": "system", "content": conv.system_prompt}]
    for k in range(turn):
        messages.append({"role": "user", "content": conv.user_turns[k]})
        messages.append({"role": "assistant", "content": replies[k]})
    messages.append({"role": "user", "content": conv.user_turns[turn]})
    return messages


@dataclass(frozen=True)
class ConversationConfig:
    num_conversations: int = 4
    #: turns per conversation, drawn uniformly from [min_turns, max_turns] per conversation
    min_turns: int = 4
    max_turns: int = 4
    #: tokens of the shared system prompt (the opening sentence included)
    system_prompt_tokens: int = 1000
    #: tokens of a user message, drawn from [user_tokens * (1 - r), user_tokens * (1 + r)]
    user_tokens: int = 32
    user_tokens_range_ratio: float = 0.5
    seed: int = 0
    #: mean seconds a user waits before each turn (before the first: the conversation's
    #: start), drawn from an exponential distribution per turn; 0: none. Without it,
    #: conversations of equal shape finish their turns in the order they started and send the
    #: next ones in that order too, so a round-robin router hands each conversation the same
    #: route turn after turn: the lockstep of a benchmark, not of users
    think_time_s: float = 0.0

    def check(self) -> None:
        """UserError naming the flag and the bad value (benchmarks/multiturn.py's names)."""
        if self.num_conversations < 1:
            raise UserError(f"--conversations: must be >= 1, got {self.num_conversations}")
        if not 1 <= self.min_turns <= self.max_turns:
            raise UserError(f"--turns: need 1 <= min <= max, got {self.min_turns}-{self.max_turns}")
        if self.system_prompt_tokens < 0:
            raise UserError(f"--system-tokens: must be >= 0, got {self.system_prompt_tokens}")
        if self.user_tokens < 1:
            raise UserError(f"--user-tokens: must be >= 1, got {self.user_tokens}")
        if not 0.0 <= self.user_tokens_range_ratio < 1.0:
            raise UserError(
                f"--user-tokens-range-ratio: must be in [0, 1), got {self.user_tokens_range_ratio}"
            )
        if not 0.0 <= self.think_time_s < float("inf"):
            raise UserError(f"--think-time-s: must be a number >= 0, got {self.think_time_s}")


def make_system_prompt(num_tokens: int, seed: int) -> str:
    """The shared system prompt: SYSTEM_OPENING, then generated instructions up to about
    `num_tokens` tokens in all (0: no system prompt text beyond the opening)."""
    opening_tokens = 14  # SYSTEM_OPENING and the paragraph break, in SmolLM2's tokenizer
    rest = num_tokens - opening_tokens
    if rest <= 0:
        return SYSTEM_OPENING
    return SYSTEM_OPENING + "\n\n" + make_text(rest, random.Random(f"system-{seed}"))


def make_conversations(cfg: ConversationConfig) -> list[Conversation]:
    """`cfg.num_conversations` conversations sharing one system prompt; the same config gives
    the same text. Each conversation's user turns come from its own seeded stream, so the
    first conversations are the same whatever the number of conversations; think times come
    from another stream, so they leave the text as it is without them."""
    cfg.check()
    system = make_system_prompt(cfg.system_prompt_tokens, cfg.seed)
    out = []
    for i in range(cfg.num_conversations):
        rng = random.Random(f"conversation-{cfg.seed}-{i}")
        turns = rng.randint(cfg.min_turns, cfg.max_turns)
        lo = cfg.user_tokens * (1 - cfg.user_tokens_range_ratio)
        hi = cfg.user_tokens * (1 + cfg.user_tokens_range_ratio)
        user = tuple(make_text(max(2, round(rng.uniform(lo, hi))), rng) for _ in range(turns))
        think: tuple[float, ...] = ()
        if cfg.think_time_s > 0:
            wait = random.Random(f"think-{cfg.seed}-{i}")
            think = tuple(wait.expovariate(1.0 / cfg.think_time_s) for _ in range(turns))
        out.append(Conversation(i, system, user, think))
    return out


def parse_turns(text: str) -> tuple[int, int]:
    """`--turns`: "4" (every conversation 4 turns) or "4-8" (drawn per conversation)."""
    try:
        lo, sep, hi = text.partition("-")
        pair = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise UserError(
            f"--turns: bad value {text!r}; expected N or MIN-MAX, e.g. 4 or 4-8"
        ) from None
    if not 1 <= pair[0] <= pair[1]:
        raise UserError(f"--turns: bad value {text!r}; need 1 <= MIN <= MAX")
    return pair
