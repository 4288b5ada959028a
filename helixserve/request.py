"""The request types the API, the coordinator and the engines share; torch-free.

`SamplingParams` says how one request's next token is chosen; the engine's sampler
(`engine/sampling.py`) applies it. A `GenerationRequest` is what the API hands the coordinator,
checked once by its `validate` (which names the bad field); `TokenEvent` is what comes back per
token. `PromptLogprob` is one prompt token's score (`echo` with logprobs). Nothing here imports
torch, so the API and the coordinator run where torch is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from helixserve.errors import UserError

#: most top logprobs per token (and per prompt token), as vLLM's default
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the sampled tokens must follow (TEMP contract shim; so-grammar's version wins)."""

    kind: Literal["json", "json_object", "regex", "choice", "lark"]
    spec: str


@dataclass
class SamplingParams:
    """How the next token of one request is chosen."""

    temperature: float = 1.0
    """0 = greedy (argmax); > 0 divides the logits."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to at least top_p; 1 = off."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) = off."""
    min_p: float = 0.0
    """Drop tokens with probability below min_p times the top token's; 0 = off."""
    seed: int | None = None
    """Seed of this request's own generator; None = a random seed."""
    repetition_penalty: float = 1.0
    """> 1 discourages any token of prompt or output; 1 = off."""
    presence_penalty: float = 0.0
    """Subtracted once from each token already generated (OpenAI range -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence of each token already generated (OpenAI range -2..2)."""
    logprobs: int | None = None
    """Return the chosen token's logprob and this many top alternatives; None = none."""
    min_tokens: int = 0
    """Mask `stop_token_ids` until this many tokens have been generated; 0 = off."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that would end the request (EOS and the request's stop ids), for `min_tokens`."""
    prompt_logprobs: int | None = None
    """Also score the prompt: each prompt token after the first gets its logprob given the
    tokens before it and this many top alternatives; None = off (no lm_head over the prompt)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value) pairs added to the logits before sampling (OpenAI range -100..100)."""
    structured: StructuredOutput | None = None
    """A grammar the output must follow; None = free generation."""

    def validate(self) -> SamplingParams:
        def bad(name: str, value: object, need: str) -> UserError:
            return UserError(f"sampling: {name}: bad value {value!r}; {need}")

        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "need 0 <= temperature <= 100")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "need 0 < top_p <= 1")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "need -1 (off), 0 (off) or a positive int")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "need 0 <= min_p <= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", self.seed, "need a non-negative int or None")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", self.repetition_penalty, "need 0 < value <= 10")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "need -2 <= value <= 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "need -2 <= value <= 2")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", self.logprobs, f"need 0..{MAX_LOGPROBS} or None")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", self.prompt_logprobs, f"need 0..{MAX_LOGPROBS} or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "need a non-negative int")
        for token_id, value in self.logit_bias:
            if not isinstance(token_id, int) or token_id < 0:
                raise bad("logit_bias", token_id, "need non-negative token ids")
            if not -100.0 <= value <= 100.0:
                raise bad("logit_bias", value, "need -100 <= bias <= 100")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Penalties or a logit bias: the row cannot take the batched greedy argmax."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class PromptLogprob:
    """One prompt token's logprob given the tokens before it, and the top alternatives there."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass
class GenerationRequest:
    """One request as the coordinator takes it: token ids in, limits and stop conditions."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    #: the context length `validate` checked this request against; 0 = not checked (the
    #: coordinator then checks it itself, once)
    checked_for_len: int = field(default=0, compare=False)

    def validate(self, max_model_len: int) -> GenerationRequest:
        """The one check of a request (UserError naming the bad field): a prompt, at least one
        token to generate, a prompt shorter than the context, sampling in range. The API runs
        it while it builds the request; the coordinator trusts a request checked for its
        context length and checks any other itself."""
        n = len(self.prompt_token_ids)
        if n == 0:
            raise UserError("prompt: empty; need at least one token")
        if self.max_tokens < 1:
            raise UserError(f"max_tokens: bad value {self.max_tokens}; must be >= 1")
        if n >= max_model_len:
            raise UserError(f"prompt: {n} tokens; the model's context is {max_model_len}")
        self.sampling.validate()
        self.checked_for_len = max_model_len
        return self


@dataclass
class TokenEvent:
    """One generated token as the coordinator streams it back."""

    token_id: int
    #: incremental detokenized text (stop strings applied and removed); may be "" while held back
    text: str
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None  # None | "stop" | "length"
    #: engine time spent on this token's step, summed over the route's hops (the rest of the
    #: token's latency is coordinator + gRPC + queueing overhead)
    compute_s: float = 0.0
    #: hops of the request's route when this token was produced
    num_hops: int = 0
    #: first token of a request whose sampling asked for prompt_logprobs: prompt tokens 1..
    #: given the tokens before each
    prompt_logprobs: list[PromptLogprob] | None = None
    #: first token only: seconds the request waited for its first route (admission queue,
    #: or the model being covered again after losing a worker)
    queue_s: float | None = None
