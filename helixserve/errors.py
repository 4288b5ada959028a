"""The one exception type for bad user input.

Anything a user can get wrong (a file, a field, a flag) raises `UserError` with a message
that names the file, the field path and the bad value. The CLI prints that one line and
exits 2; the API turns it into an HTTP 400 with the OpenAI error JSON.
"""

from os import PathLike
from pathlib import Path


class UserError(ValueError):
    """Bad input from the user: message names the file, field and value."""


def read_user_file(path: str | PathLike[str], what: str) -> str:
    """The text of a file the user named; a missing, unreadable or non-UTF-8 file is a
    `UserError` naming the file and `what` it was meant to be."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{p}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{p}: cannot read {what}: not UTF-8 text (byte "
                        f"0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
