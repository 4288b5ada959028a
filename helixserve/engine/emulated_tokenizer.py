"""`EmulatedTokenizer`: a stand-in tokenizer for a model directory that holds only a
config.json (a rehearsal of a 70B model has no weights and often no tokenizer files).

Deterministic and vocabulary-sized, so that the real coordinator and API run over emulated
workers: text is split at whitespace, each word into pieces of at most `PIECE_CHARS`
characters, one token each (the bench client's prompts, words of one token each, come out at
the length they were built for); a piece maps to an id by a hash, outside the special ids
(BOS, EOS); a piece spelled like an emulated token's own text (`tok123`) maps back to it. Id
`i` decodes to " tok<i>", so decoding is a concatenation and the coordinator's incremental
detokenizer emits exactly one piece per token. It has a plain chat template
("role: content" lines). Nothing in its output is meaningful text: it is labelled
(`name_or_path` "emulated:<dir>", `is_emulated`), and the coordinator logs that it is used.
Torch-free; no transformers.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

#: files any of which means the directory has a real tokenizer (transformers loads it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
#: characters of text per token at most
PIECE_CHARS = 8
_TOKEN_TEXT = re.compile(r"tok(\d+)")
_WORDS = re.compile(r"\S+")
#: pieces whose ids `encode` keeps at most
_KNOWN_PIECES = 1 << 16


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds tokenizer files (else it is a config-only directory)."""
    p = Path(model_dir)
    return not p.is_dir() or any((p / f).is_file() for f in TOKENIZER_FILES)


class EmulatedTokenizer:
    """The tokenizer methods the coordinator and the API call (module doc)."""

    is_emulated = True
    chat_template = "emulated: role: content lines"

    def __init__(self, vocab_size: int, bos_token_id: int | None = 1,
                 eos_token_id: int | None = 2, name: str = "emulated") -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.name_or_path = name
        self._special = {t for t in (bos_token_id, eos_token_id) if t is not None}
        self._vocab: dict[str, int] | None = None
        #: piece -> id, for the pieces seen (a prompt repeats its words; bounded)
        self._ids: dict[str, int] = {}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> EmulatedTokenizer:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())

        def first(value: Any) -> int | None:
            if isinstance(value, list):
                return int(value[0]) if value else None
            return None if value is None else int(value)

        return cls(int(cfg.get("vocab_size") or 32000), first(cfg.get("bos_token_id")),
                   first(cfg.get("eos_token_id")), name=f"emulated:{model_dir}")

    def __len__(self) -> int:
        return self.vocab_size

    # ---- text -> ids ---------------------------------------------------------------------
    def piece_id(self, piece: str) -> int:
        m = _TOKEN_TEXT.fullmatch(piece)
        if m is not None and int(m.group(1)) < self.vocab_size:
            return int(m.group(1))
        token = zlib.crc32(piece.encode()) % self.vocab_size
        while token in self._special:
            token = (token + 1) % self.vocab_size
        return token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        known = self._ids
        for word in _WORDS.findall(text):
            pieces = (word,) if len(word) <= PIECE_CHARS else [
                word[i : i + PIECE_CHARS] for i in range(0, len(word), PIECE_CHARS)]
            for piece in pieces:
                token = known.get(piece)
                if token is None:
                    if len(known) >= _KNOWN_PIECES:
                        known.clear()
                    token = known[piece] = self.piece_id(piece)
                ids.append(token)
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    # ---- ids -> text ---------------------------------------------------------------------
    def convert_ids_to_tokens(self, token_id: int) -> str:
        if token_id == self.bos_token_id:
            return "<s>"
        if token_id == self.eos_token_id:
            return "</s>"
        return f"tok{token_id}"

    def decode(self, ids: list[int] | int, skip_special_tokens: bool = False, **_: Any) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return "".join("" if skip_special_tokens and t in self._special
                       else " " + self.convert_ids_to_tokens(int(t)) for t in ids)

    def get_vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = {self.convert_ids_to_tokens(i): i for i in range(self.vocab_size)}
        return self._vocab

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = True,
                            add_generation_prompt: bool = False, **_: Any) -> Any:
        text = "".join(f"{m.get('role', 'user')}: {m.get('content', '')}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant:"
        return self.encode(text, add_special_tokens=False) if tokenize else text
