"""What the commands share: one-line usage errors, finite number flags, and output files
checked before the work starts and then written all or none.

Not a command itself (cli.py lists the commands). Standard library only at module level,
as every command module.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from helixserve.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's rule for bad input: one line on stderr and exit 2,
    `helixserve plan: error: argument --seed: invalid int value: 'x'`, without the usage
    block (--help still prints it all)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.replace(chr(10), ' ')}\n")

    def _parse_optional(self, arg_string: str) -> Any:
        # A value that starts with '-' and a digit is a value, not an unknown option:
        # argparse takes only plain negative numbers for values, so `--workload -5:10`
        # ended as "expected one argument" instead of the flag's own check of -5:10.
        if (len(arg_string) > 1 and arg_string[0] == "-" and arg_string[1] in _DIGITS
                and arg_string not in self._option_string_actions):
            return None
        return super()._parse_optional(arg_string)


_DIGITS = frozenset("0123456789.")


def finite_float(text: str) -> float:
    """argparse type of the float flags: a number, but not nan or inf (both parse as floats
    and pass every `value > 0` check, then spin or poison the work)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}; need a finite number")
    return value


def check_output(flag: str, path: str | os.PathLike[str], *, directory: bool = False,
                 make_parents: bool = False) -> Path:
    """The path an output flag names, checked before the work that produces the output: a
    file (or with `directory`, a directory) can be written there. The parent directory must
    exist unless `make_parents` (directories are always created with their parents); then
    the nearest one that exists must be a directory. UserError naming the flag and path."""
    p = Path(path)
    where = f"{flag} {path}"
    if directory and p.exists():
        if not p.is_dir():
            raise UserError(f"{where}: exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UserError(f"{where}: directory is not writable")
        return p
    if not directory and p.is_dir():
        raise UserError(f"{where}: is a directory")
    parent = p.parent
    if directory or make_parents:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if not parent.exists():
        raise UserError(f"{where}: directory {parent} does not exist")
    if not parent.is_dir():
        raise UserError(f"{where}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{where}: directory {parent} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{where}: file is not writable")
    return p


def check_image(flag: str, path: str | os.PathLike[str]) -> Path:
    """`check_output` for a plot: also the suffix is an image format matplotlib writes (it
    picks the format by suffix; none means PNG)."""
    p = check_output(flag, path)
    suffix = p.suffix.lower().lstrip(".")
    if suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        known = FigureCanvasBase.get_supported_filetypes()
        if suffix not in known:
            raise UserError(f"{flag} {path}: unknown image format '.{suffix}'; known: "
                            f"{', '.join(sorted(known))}")
    return p


@dataclass(frozen=True)
class Output:
    """One output of a command: `write(path)` writes the file at `path`, or with
    `directory`, creates the directory `path` and writes files into it."""

    flag: str
    path: Path
    write: Callable[[Path], object]
    directory: bool = False


def write_outputs(outputs: Sequence[Output]) -> list[Path]:
    """Write every output or none; returns the files written.

    Each output is first written under its own name (matplotlib picks the format by the
    suffix) into a fresh hidden directory beside its target; only when all are written are
    they moved into place, so a failure leaves neither a partial file nor some outputs
    without the others. An OSError is a UserError naming the flag and path."""
    staging: list[Path] = []
    created: list[Path] = []  # directories made here, removed again if anything fails
    staged: list[tuple[Output, Path, Path]] = []  # (output, written, target)
    written: list[Path] = []
    try:
        for out in outputs:
            # through a symlink to the file it names, not over the link
            target = out.path.resolve() if out.path.is_symlink() else out.path
            try:
                home = target if out.directory else target.parent
                _make_dirs(home, created)
                tmp = Path(tempfile.mkdtemp(prefix=".helixserve-", dir=home))
                staging.append(tmp)
                out.write(tmp / target.name)
            except OSError as exc:
                raise UserError(f"{out.flag} {out.path}: cannot write: "
                                f"{exc.strerror or exc}") from None
            staged.append((out, tmp / target.name, target))
        for out, src, target in staged:
            try:
                if out.directory:
                    for f in sorted(src.iterdir()):
                        os.replace(f, target / f.name)
                        written.append(out.path / f.name)
                else:
                    os.replace(src, target)
                    written.append(out.path)
            except OSError as exc:
                raise UserError(f"{out.flag} {out.path}: cannot write: "
                                f"{exc.strerror or exc}") from None
        created.clear()
    finally:
        for tmp in staging:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
    return written


def _make_dirs(d: Path, created: list[Path]) -> None:
    """mkdir -p, recording each directory it makes in `created`."""
    missing = []
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir()
        created.append(m)
