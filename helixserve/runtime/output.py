"""Turning a request's sampled tokens into streamed text: incremental detokenization, stop
strings, stop tokens, min/max tokens. Pure Python over a tokenizer; no I/O.

Detokenization follows vLLM's offset scheme: decode a short window of the last tokens twice
(with and without the new token) and emit the difference, holding text back while it ends in
an incomplete UTF-8 sequence ("\\ufffd"). Cost per token is O(window), not O(length).

Stop strings: text that could still be the start of a stop string is held back; once a stop
string appears the text before it is emitted, the stop string and everything after dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from helixserve.request import GenerationRequest

#: tokens decoded before the new one, so that merges across token boundaries come out right
_PREFIX_WINDOW = 6


def _decoder(tokenizer: Any) -> Any:
    """ids -> text without special tokens. A fast (Rust) tokenizer that cleans up no spaces
    decodes exactly as its backend does: call that directly, without the Python wrapper's
    conversions (twice per token on the coordinator's hot path)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class StepOutput:
    text: str
    finish_reason: str | None  # None | "stop" | "length"


@dataclass
class OutputProcessor:
    tokenizer: Any
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    #: sequence cap (prompt + output) of the model
    max_model_len: int | None = None

    @classmethod
    def for_request(cls, req: GenerationRequest, tokenizer: Any, eos_token_ids: list[int],
                    max_model_len: int | None) -> OutputProcessor:
        """The stop conditions and limits of `req`, over the model's EOS ids and length."""
        return cls(tokenizer=tokenizer, prompt_token_ids=req.prompt_token_ids,
                   max_tokens=req.max_tokens, min_tokens=req.min_tokens, stop=list(req.stop),
                   stop_token_ids=list(req.stop_token_ids), eos_token_ids=eos_token_ids,
                   ignore_eos=req.ignore_eos, max_model_len=max_model_len)

    def __post_init__(self) -> None:
        self.output_ids: list[int] = []
        # Decode window: the prompt's last tokens give left context (a leading space decodes
        # as inside the sequence); ids[prefix_offset:read_offset] is text already emitted.
        self._ids: list[int] = list(self.prompt_token_ids[-_PREFIX_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded text not yet emitted (stop-string hold-back)
        self._stop_ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            self._stop_ids |= set(self.eos_token_ids)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.finished = False
        self._decode = _decoder(self.tokenizer)

    def add(self, token_id: int) -> StepOutput:
        """Account one sampled token; returns the text delta to stream and the finish reason."""
        assert not self.finished, "token after finish"
        self.output_ids.append(token_id)
        self._ids.append(token_id)
        n = len(self.output_ids)
        if token_id in self._stop_ids and n > self.min_tokens:
            # The stop token's own text is not part of the output (as in vLLM / OpenAI).
            self.finished = True
            return StepOutput(self._flush(), "stop")
        self._pending += self._decode_new()
        if self.stop and n > self.min_tokens:
            cut = self._find_stop()
            if cut is not None:
                text = self._pending[:cut]
                self._pending = ""
                self.finished = True
                return StepOutput(text, "stop")
        at_cap = self.max_model_len is not None and len(self.prompt_token_ids) + n >= self.max_model_len
        if n >= self.max_tokens or at_cap:
            self.finished = True
            return StepOutput(self._flush(), "length")
        return StepOutput(self._emit(), None)

    def _decode_new(self) -> str:
        ids = self._ids
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        full = self._decode(ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete UTF-8 sequence: wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix) :]

    def _find_stop(self) -> int | None:
        best: int | None = None
        for s in self.stop:
            i = self._pending.find(s)
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _emit(self) -> str:
        """Emit pending text except a tail that may be the beginning of a stop string."""
        if not self.stop:
            text, self._pending = self._pending, ""
            return text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self._pending) - hold
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text

    def _flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
