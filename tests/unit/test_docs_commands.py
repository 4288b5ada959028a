"""Every documented command works from a fresh clone (issue 33).

The commands are the fenced ```bash blocks of README.md, docs/*.md and deploy/**/README.md.
A block is run, line by line (a line ending in `\\` goes on), with bash from the repository
root of a clean copy of the repository (its git files, nothing built or generated), with
`helixserve` and `python` those of this interpreter and the copy on PYTHONPATH. A command
that exits non-zero fails the test. `pip install ...` is not run (the install is this
environment's), but the extras it names must exist in pyproject.toml; a line that installs
only the control plane (`pip install -e .`) runs with the optional packages (torch, grpc,
fastapi, cryptography, ...) made unimportable, as on that install.

A block preceded by an HTML comment `<!-- heavy: why -->` (on the line before the fence)
is not run (it starts servers or takes minutes, or is a template with placeholders); each
`helixserve SUB` line of it is checked to parse: SUB is a command and every `--flag` it
uses is one of that command's flags (as `helixserve SUB --help` lists them); each
`python -m benchmarks.x` line likewise against `python -m benchmarks.x --help`. Paths of the
repository the heavy block names (`benchmarks/x.py`, `deploy/docker/Dockerfile.cpu`,
`tests/...`) must exist. Inline `helixserve ...` code spans (tables) are checked the same
way. Commands outside a ```bash fence (an untyped fence or an indented block) fail the test:
they would escape both checks.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHELLS = ("bash", "sh", "shell", "console")
HEAVY = re.compile(r"<!--\s*heavy\b")
#: a line that is a shell command (in an untyped fence: an error)
COMMAND = re.compile(r"\s*(\$ )?(\w+=\S*\s+)*(helixserve|python|pip|kubectl|docker|helm|curl)"
                     r"\s")
#: the packages a control-plane install (`pip install -e .`) does not have
OPTIONAL = ("torch", "vllm", "grpc", "grpc_health", "fastapi", "uvicorn", "cryptography",
            "transformers", "safetensors", "tokenizers", "prometheus_client", "openai")
#: repository paths a heavy command may name, checked to exist
REPO_PATH = re.compile(r"(?<![\w./-])((?:benchmarks|deploy|tests|docs|examples|helixserve)"
                       r"/[\w./-]*\w)")
#: one command may take this long; the whole test is budgeted in the docs' light commands
COMMAND_TIMEOUT_S = 240


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "deploy").glob("**/README.md"))]


@dataclass(frozen=True)
class Block:
    doc: Path  # relative to the repository
    line: int  # of the opening fence, 1-based
    info: str
    heavy: bool
    commands: tuple[str, ...]  # logical lines: continuations joined, comment lines dropped

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w-]*)")


def parse_blocks(doc: Path, root: Path = REPO) -> tuple[list[Block], list[str]]:
    """The fenced blocks of `doc`, and the problems: commands outside a ```bash fence."""
    name = doc.relative_to(root)
    lines = doc.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if re.match(r"^ {4,}(helixserve |python (-m )?benchmarks)", lines[i]):
                problems.append(f"{name}:{i + 1}: a command in an "
                                "indented block; put it in a ```bash fence")
            i += 1
            continue
        indent, fence, info = m.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i < len(lines) and lines[i].strip() != fence:
            problems.append(f"{name}:{i + 1}: a fence with an info string closes the block "
                            f"opened at line {start + 1} (an unclosed fence above?)")
        elif i >= len(lines):
            problems.append(f"{name}:{start + 1}: a fence that is never closed")
        i += 1
        before = lines[start - 1] if start > 0 else ""
        if info in SHELLS:
            blocks.append(Block(name, start + 1, info, bool(HEAVY.search(before)),
                                tuple(logical_lines(body))))
        elif not info and any(COMMAND.match(b) for b in body):
            problems.append(f"{name}:{start + 1}: commands in an untyped fence; make it "
                            "```bash (and mark it <!-- heavy: ... --> if it must not run)")
    return blocks, problems


def logical_lines(body: list[str]) -> list[str]:
    out: list[str] = []
    current = ""
    for raw in body:
        line = re.sub(r"\s+#\s.*$", "", raw).strip()  # a comment after the command
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1].rstrip() + " "
            continue
        out.append(current + line)
        current = ""
    if current.strip():
        out.append(current.strip())
    return out


def all_blocks() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    problems: list[str] = []
    for doc in doc_files():
        b, p = parse_blocks(doc)
        blocks += b
        problems += p
    return blocks, problems


# ---- checks of commands that are not run --------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_helixserve_flags(command: str, where: str) -> list[str]:
    """`helixserve SUB [SUBSUB] --flag ...` parses: SUB is a command and each --flag one of
    its flags. Placeholders (`C.yaml`, `...`, `[--plot P]`) are allowed."""
    from helixserve.cli import build_parser

    words = command.replace("[", " ").replace("]", " ").replace("|", " ").split()
    while words and re.match(r"^\w+=", words[0]):
        words.pop(0)  # VAR=value before the command
    if not words or words[0] != "helixserve":
        return []
    words = words[1:]
    if not words or words[0].startswith("-") or words[0].endswith(":"):
        return []  # `helixserve --version`; `helixserve plan: error: ...` is a message
    parser = build_parser()
    path = ["helixserve"]
    while words and not words[0].startswith("-") and _subparsers(parser):
        sub = _subparsers(parser)
        if words[0] not in sub:
            if len(path) == 1:
                return [f"{where}: `{command}`: unknown command {words[0]!r}; known: "
                        f"{', '.join(sub)}"]
            break
        parser = sub[words[0]]
        path.append(words.pop(0))
    options = set(parser._option_string_actions)
    problems = []
    for word in words:
        m = re.fullmatch(r"(--[a-z][a-z0-9-]*)(\*|\.\.\.)?", word.split("=")[0])
        if m is None:
            continue
        flag, wildcard = m.groups()
        known = any(o.startswith(flag) for o in options) if wildcard else flag in options
        if not known:
            problems.append(f"{where}: `{command}`: {' '.join(path)} has no flag "
                            f"{flag}{wildcard or ''}")
    return problems


def check_not_run(command: str, where: str, root: Path) -> list[str]:
    problems = []
    for segment in re.split(r"&&|\|\||;|\|", command):
        segment = segment.strip()
        if segment.startswith("pip install"):
            problems += check_pip(segment, where)
        else:
            problems += check_helixserve_flags(segment, where)
            problems += check_script_flags(segment, where, root)
    for path in REPO_PATH.findall(command):
        if not (root / path).exists() and "results/" not in path:
            problems.append(f"{where}: `{command}`: no {path} in the repository")
    return problems


_SCRIPT_HELP: dict[Path, str] = {}


def check_script_flags(segment: str, where: str, root: Path) -> list[str]:
    """`python -m benchmarks.x --flag ...` (or `python benchmarks/x.py`): the module exists
    and each --flag is in its `--help`."""
    m = re.match(r"^(?:\w+=\S*\s+)*python\s+(?:-m\s+(benchmarks(?:\.\w+)+)|"
                 r"(benchmarks/[\w/]+\.py))\b(.*)$", segment)
    if m is None:
        return []
    module, path, rest = m.groups()
    if module is not None:
        parts = module.split(".")
        script = root.joinpath(*parts).with_suffix(".py")
        if not script.is_file():
            script = root.joinpath(*parts, "__main__.py")
        if not script.is_file():
            return [f"{where}: `{segment}`: no module {module} in the repository"]
        cmd, name = [sys.executable, "-m", module, "--help"], module
    else:
        script = root / path
        if not script.is_file():
            return []  # the path check names it
        cmd, name = [sys.executable, str(script), "--help"], path
    if script not in _SCRIPT_HELP:
        proc = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                              capture_output=True, text=True, timeout=120)
        _SCRIPT_HELP[script] = proc.stdout if proc.returncode == 0 else ""
        if proc.returncode != 0:
            return [f"{where}: `{segment}`: {name} --help exited {proc.returncode}: "
                    f"{proc.stderr.strip().splitlines()[-1:]}"]
    text = _SCRIPT_HELP[script]
    return [f"{where}: `{segment}`: {name} has no flag {flag}"
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]


def check_pip(segment: str, where: str) -> list[str]:
    """The extras a `pip install -e '.[a,b]'` names are pyproject.toml's."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    problems = []
    for group in re.findall(r"\.\[([\w,-]+)\]", segment):
        for extra in group.split(","):
            if extra not in extras:
                problems.append(f"{where}: `{segment}`: no extra {extra!r} in pyproject.toml; "
                                f"known: {', '.join(extras)}")
    return problems


def control_plane_only(command: str) -> bool:
    """The line installs only the control plane: `pip install -e .` (no extras)."""
    return bool(re.search(r"pip install (-e )?\.(\s|$|&)", command + " "))


# ---- running the light ones ---------------------------------------------------------------

def clean_copy(dest: Path) -> Path:
    """The repository's files as a clone has them (tracked, plus new files not ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=REPO, capture_output=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): no clean copy to run the docs from")
    root = dest / "repo"
    for name in sorted(set(out.decode().split("\0")) - {""}):
        src, dst = REPO / name, root / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree, not yet in the index
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return root


def shims(dest: Path) -> Path:
    """bin/ with `helixserve` and `python` of this interpreter, and a sitecustomize that
    makes the packages in $HELIXSERVE_DOCTEST_BLOCK unimportable."""
    bin_dir = dest / "bin"
    bin_dir.mkdir()
    # scripts, not symlinks: a venv's python finds its pyvenv.cfg beside the path it is run by
    for name, run in (("helixserve", "-m helixserve "), ("python", "")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" {run}"$@"\n')
        (bin_dir / name).chmod(0o755)
    site = dest / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.abc, os, sys\n"
        "_BLOCKED = set(filter(None, os.environ.get('HELIXSERVE_DOCTEST_BLOCK', '').split(',')))\n"
        "class _Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in _BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (control-plane "
        "install)', name=name)\n"
        "if _BLOCKED:\n"
        "    sys.meta_path.insert(0, _Block())\n")
    return bin_dir


def runnable(command: str) -> str:
    """The line as run: `pip install ...` segments are this environment's install."""
    return " && ".join(":" if seg.strip().startswith("pip install") else seg
                       for seg in command.split("&&"))


def test_every_command_is_in_a_bash_fence() -> None:
    blocks, problems = all_blocks()
    assert not problems, "\n".join(problems)
    assert any(not b.heavy for b in blocks) and any(b.heavy for b in blocks)


def test_heavy_and_inline_commands_parse() -> None:
    blocks, _ = all_blocks()
    problems: list[str] = []
    for block in blocks:
        for command in block.commands:
            if block.heavy:
                problems += check_not_run(command, block.where, REPO)
            else:
                for segment in command.split("&&"):
                    if segment.strip().startswith("pip install"):
                        problems += check_pip(segment, block.where)
    for doc in doc_files():
        text = doc.read_text()
        for m in re.finditer(r"(?<!`)`(helixserve [^`]+)`", text):
            line = text[:m.start()].count("\n") + 1
            problems += check_helixserve_flags(m.group(1), f"{doc.relative_to(REPO)}:{line}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_light_commands_run_from_a_clean_copy(tmp_path: Path) -> None:
    blocks, _ = all_blocks()
    light = [b for b in blocks if not b.heavy]
    bin_dir = shims(tmp_path)
    # the control-plane install's block is real: torch does not import under it
    blocked = subprocess.run([str(bin_dir / "python"), "-c", "import torch"], env={
        **os.environ, "PYTHONPATH": str(tmp_path / "site"),
        "HELIXSERVE_DOCTEST_BLOCK": ",".join(OPTIONAL)}, capture_output=True, text=True,
        timeout=60)
    assert blocked.returncode != 0 and "control-plane install" in blocked.stderr
    failures: list[str] = []
    timings: list[str] = []
    by_doc: dict[Path, list[Block]] = {}
    for block in light:
        by_doc.setdefault(block.doc, []).append(block)
    for doc, doc_blocks in by_doc.items():
        # each doc in its own copy: its commands may use what its earlier ones wrote
        root = clean_copy(tmp_path / str(doc).replace("/", "_"))
        for block in doc_blocks:
            for command in block.commands:
                env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                       "PYTHONPATH": f"{root}{os.pathsep}{tmp_path / 'site'}",
                       "HELIXSERVE_DOCTEST_BLOCK":
                           ",".join(OPTIONAL) if control_plane_only(command) else "",
                       "MPLBACKEND": "Agg"}
                started = time.perf_counter()
                try:
                    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", runnable(command)],
                                          cwd=root, env=env, capture_output=True, text=True,
                                          timeout=COMMAND_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    failures.append(f"{block.where}: `{command}`: still running after "
                                    f"{COMMAND_TIMEOUT_S} s; give it a smaller budget or mark "
                                    "the block <!-- heavy: ... -->")
                    continue
                timings.append(f"{time.perf_counter() - started:6.1f} s  {block.where}")
                if proc.returncode != 0:
                    tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
                    failures.append(f"{block.where}: `{command}` exited {proc.returncode}: "
                                    + " | ".join(tail))
    print("\n".join(timings))
    assert not failures, "\n".join(failures)


def test_the_checks_catch_bad_commands(tmp_path: Path) -> None:
    """The parse checks and the block rules reject what they should (not tests that pass on
    anything)."""
    assert check_helixserve_flags("helixserve plan --example --time-limt 5", "x") == [
        "x: `helixserve plan --example --time-limt 5`: helixserve plan has no flag --time-limt"]
    assert check_helixserve_flags("helixserve deploy k8s --cluster C.yaml ... --out k8s/",
                                  "x") == []
    assert check_helixserve_flags("helixserve deploy k8s --plot p", "x")
    assert check_helixserve_flags("helixserve plann --example", "x")
    assert check_not_run("python benchmarks/nope.py --json x.json", "x", REPO)
    assert check_not_run("python -m benchmarks.nope --json x.json", "x", REPO)
    assert check_not_run("python -m benchmarks.replan --time-limt 60", "x", REPO) == [
        "x: `python -m benchmarks.replan --time-limt 60`: benchmarks.replan has no flag "
        "--time-limt"]
    assert not check_not_run("python -m benchmarks.replan --time-limit 60", "x", REPO)
    assert check_pip("pip install -e '.[nosuch]'", "x")
    assert not check_pip("pip install -e '.[serve]'", "x")
    assert control_plane_only("pip install -e . && helixserve plan --example")
    assert not control_plane_only("pip install -e '.[serve]' && helixserve demo")
    doc = tmp_path / "d.md"
    doc.write_text("```\nPYTHONPATH=. python benchmarks/x.py\n```\n\n    helixserve evaluate --x\n\n"
                   "<!-- heavy: a server -->\n```bash\nhelixserve demo \\\n  --port 1\n```\n")
    blocks, problems = parse_blocks(doc, tmp_path)
    assert len(problems) == 2, problems
    doc.write_text("```\noutput\n```bash\nhelixserve plan --example\n```\n")
    assert "closes the block opened at line 1" in parse_blocks(doc, tmp_path)[1][0]
    assert [(b.heavy, b.commands) for b in blocks] == [(True, ("helixserve demo --port 1",))]


def test_shlex_reads_every_command() -> None:
    """Quotes in the docs' commands are balanced (a broken copy-paste otherwise)."""
    blocks, _ = all_blocks()
    problems = []
    for block in blocks:
        for command in block.commands:
            try:
                shlex.split(command, comments=True)
            except ValueError as exc:
                problems.append(f"{block.where}: `{command}`: {exc}")
    assert not problems, "\n".join(problems)
