"""The request mix a plan is built for: mean prompt and output tokens per request.

The max flow's unit is one *output* token per second of this mix (docs/planner.md,
"Workload-aware planning"). Every output token brings r = P / O prompt tokens to prefill
(P, O: mean prompt and output tokens per request), so a node holding k layers spends

    s(k) = k t_decode(b) / b  +  r k t_prompt(P') / P'        seconds per output token

(b = the decode batch b(k) of the decode-only model, P' = P capped at the node's prompt
batch limit) and its capacity is T(k) = 1 / s(k); an activation link carries 1 + r
tokens' hidden states per output token, the coordinator's link to the first stage 1 + r
token ids (prompt + the token fed back each step), the last stage's link back one (the
sampled token). A flow F then serves F / O requests/s. r = 0 is Helix's decode-only T(k).

Pure data, no I/O: `helixserve.simulator.mix.parse_workload` reads a trace or a "P:O" pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from helixserve.errors import UserError

#: mean prompt and output tokens of the Azure LLM conversation trace (2023,
#: examples/traces/azure-llm-conv-2023.csv) after Helix's length filter (prompts and
#: outputs of 4..2048 / 4..1024 tokens: 16,657 of 19,366 requests), the simulator's and the
#: benchmarks' default trace; tests/unit/costmodel/test_workload.py recomputes them
CONVERSATION_PROMPT_TOKENS = 763.08
CONVERSATION_OUTPUT_TOKENS = 232.45


@dataclass(frozen=True)
class Workload:
    """Mean request lengths of a serving mix; the unit of the max flow is one output token/s."""

    #: mean prompt tokens per request (P), >= 0; 0 is the decode-only model
    prompt_tokens: float
    #: mean output tokens per request (O), > 0
    output_tokens: float
    #: where the numbers came from, for messages and reports ("conversation", a file, "P:O")
    source: str = ""

    def __post_init__(self) -> None:
        where = f"workload {self.source}: " if self.source else "workload: "
        if not (self.prompt_tokens >= 0 and self.prompt_tokens < 1e9):
            raise UserError(f"{where}prompt_tokens: bad value {self.prompt_tokens!r}; "
                            f"need a mean prompt length >= 0 tokens")
        if not (self.output_tokens > 0 and self.output_tokens < 1e9):
            raise UserError(f"{where}output_tokens: bad value {self.output_tokens!r}; "
                            f"need a mean output length > 0 tokens")

    @classmethod
    def conversation(cls) -> Workload:
        """The Azure conversation mix (r = 3.28), `--workload conversation`."""
        return cls(CONVERSATION_PROMPT_TOKENS, CONVERSATION_OUTPUT_TOKENS, "conversation")

    @classmethod
    def from_lengths(cls, prompt_tokens: list[int], output_tokens: list[int],
                     source: str = "") -> Workload:
        """Means of per-request prompt and output lengths (a trace's:
        `TraceRequest.prompt_tokens` / `output_tokens`)."""
        if not prompt_tokens or len(prompt_tokens) != len(output_tokens):
            raise UserError(f"workload {source}: need one prompt and one output length per "
                            f"request; got {len(prompt_tokens)} and {len(output_tokens)}")
        return cls(sum(prompt_tokens) / len(prompt_tokens),
                   sum(output_tokens) / len(output_tokens), source)

    @property
    def prompt_tokens_per_output_token(self) -> float:
        """r = P / O: prompt tokens prefilled for each output token generated."""
        return self.prompt_tokens / self.output_tokens

    @property
    def activation_tokens_per_output_token(self) -> float:
        """1 + r: token positions whose hidden states cross a link per output token."""
        return 1.0 + self.prompt_tokens_per_output_token

    @property
    def kv_tokens_per_request(self) -> int:
        """P + O: KV slots a request holds on each layer at its end (the decode batch's
        `context_tokens` under this mix)."""
        return max(1, round(self.prompt_tokens + self.output_tokens))

    def requests_per_s(self, output_tokens_per_s: float) -> float:
        """Requests/s a flow of `output_tokens_per_s` serves."""
        return output_tokens_per_s / self.output_tokens

    def describe(self) -> str:
        """'conversation (P 763, O 232, r 3.28)'."""
        name = self.source or "workload"
        return (f"{name} (prompt {self.prompt_tokens:,.0f}, output {self.output_tokens:,.0f} "
                f"tokens; r {self.prompt_tokens_per_output_token:.2f})")
