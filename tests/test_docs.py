"""The documentation points at real things: every relative link in README.md and docs/
resolves to a file or directory, every `make TARGET` is a Makefile rule, and every
`tandem SUBCOMMAND --flag` is a subcommand that accepts that flag.

Only code (fenced blocks and inline code spans) is read for commands; only prose for links.
Fast and offline: each subcommand's `--help` runs once, in a subprocess.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from tandem import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS_DIR = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS_DIR.rglob("*.md"))]


@dataclass(frozen=True)
class Code:
    """A piece of code in a document: one line of a fenced block, or one inline span."""

    path: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Doc:
    path: Path
    prose: str  # the text with code blocks and inline code blanked out (offsets kept)
    code: tuple[Code, ...]
    anchors: frozenset[str]  # GitHub's ids of its headings

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1


FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def _blank(text: str) -> str:
    return re.sub(r"[^\n]", " ", text)


@functools.cache
def parse(path: Path) -> Doc:
    lines = path.read_text(encoding="utf-8").split("\n")
    code: list[Code] = []
    prose_lines: list[str] = []
    fence: str | None = None
    for number, line in enumerate(lines, start=1):
        opener = FENCE.match(line)
        if fence is None and opener:
            fence = opener.group(1)
            prose_lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            else:
                code.append(Code(path, number, line))
            prose_lines.append("")
        else:
            prose_lines.append(line)
    prose = "\n".join(prose_lines)
    for match in INLINE_CODE.finditer(prose):
        span = " ".join(match.group(2).split())
        code.append(Code(path, prose.count("\n", 0, match.start()) + 1, span))
    masked = INLINE_CODE.sub(lambda m: _blank(m.group(0)), prose)
    return Doc(path, masked, tuple(code), _anchors(prose_lines))


HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)[ \t#]*$")


def _anchors(prose_lines: list[str]) -> frozenset[str]:
    """GitHub's heading ids: the text lower-cased, punctuation dropped, spaces as '-',
    a repeated id numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose_lines:
        match = HEADING.match(line)
        if not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(anchors)


# ---------------------------------------------------------------------------- links

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_LINK = re.compile(r"^[ \t]{0,3}\[[^\]]+\]:[ \t]*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)  # http:, https:, mailto:, ...


def broken_links(path: Path) -> list[str]:
    doc = parse(path)
    broken = []
    for pattern in (INLINE_LINK, REFERENCE_LINK):
        for match in pattern.finditer(doc.prose):
            target = match.group(1)
            if not target or target.startswith("#") or EXTERNAL.match(target):
                continue
            file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
            base = ROOT if file_part.startswith("/") else path.parent
            resolved = (base / file_part.lstrip("/")).resolve()
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}:{doc.line_of(match.start())}: {target!r}")
    return broken


def test_relative_links_resolve() -> None:
    broken = [b for path in doc_files() for b in broken_links(path)]
    assert not broken, "links to files or directories that do not exist:\n  " + "\n  ".join(broken)


def broken_anchors(path: Path) -> list[str]:
    """`#anchor`s, in this document or another one's, that name no heading there."""
    doc = parse(path)
    broken = []
    for match in INLINE_LINK.finditer(doc.prose):
        target = match.group(1)
        if "#" not in target or EXTERNAL.match(target):
            continue
        file_part, anchor = target.split("#", 1)
        linked = (path.parent / unquote(file_part)).resolve() if file_part else path
        if linked.suffix == ".md" and linked.is_file() and anchor not in parse(linked).anchors:
            broken.append(f"{path.relative_to(ROOT)}:{doc.line_of(match.start())}: {target!r}")
    return broken


def test_heading_anchors_exist() -> None:
    broken = [b for path in doc_files() for b in broken_anchors(path)]
    assert not broken, "links to headings that do not exist:\n  " + "\n  ".join(broken)


def test_readme_links_every_docs_page() -> None:
    pages = sorted(p for p in DOCS_DIR.rglob("*.md") if p.name != "README.md")
    assert pages, "docs/ has no pages"
    for index in (README, DOCS_DIR / "README.md"):
        linked = set()
        for match in INLINE_LINK.finditer(parse(index).prose):
            target = match.group(1).split("#", 1)[0]
            if target and not EXTERNAL.match(target):
                linked.add((index.parent / unquote(target)).resolve())
        missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked]
        assert not missing, f"{index.relative_to(ROOT)} does not link to: {', '.join(missing)}"


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    count = len(text.splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines (at most {README_MAX_LINES}): move reference material to docs/"
    )
    assert text.startswith("# Tandem\n"), "README.md must start with its title"
    for command in ("make serve", "make test"):  # .ci/run runs `make test`
        assert command in text, f"README.md no longer names `{command}`"


# ---------------------------------------------------------------------- make targets

MAKE_TARGET = re.compile(r"(?<![\w./-])make\s+([A-Za-z0-9_][\w.-]*)")
RULE = re.compile(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*::?(?!=)", re.MULTILINE)


@functools.cache
def makefile_targets() -> frozenset[str]:
    """Targets with a rule (`target:` lines); `.PHONY` alone declares no target."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = {t for match in RULE.finditer(text) for t in match.group(1).split()}
    return frozenset(t for t in targets if not t.startswith("."))


def test_make_targets_exist() -> None:
    targets = makefile_targets()
    assert {"serve", "test"} <= targets, f"Makefile parse found only {sorted(targets)}"
    unknown = [
        f"{code.where()}: make {match.group(1)}"
        for path in doc_files()
        for code in parse(path).code
        for match in MAKE_TARGET.finditer(code.text)
        if match.group(1) not in targets
    ]
    assert not unknown, (
        f"`make` targets the Makefile does not define (it has: {', '.join(sorted(targets))}):\n  "
        + "\n  ".join(unknown)
    )


# ------------------------------------------------------------------- tandem commands

TANDEM_COMMAND = re.compile(r"(?<![\w./-])tandem\s+([a-z][a-z0-9-]*)")  # not a path's .../tandem
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# Where a command's arguments end on a line: a comment, `&`, `&&`, `;` or an unescaped pipe
# (tables escape the `|` of alternatives as `\|`).
END_OF_COMMAND = re.compile(r"\s#|&|;|(?<!\\)\|")
OPTION_LINE = re.compile(r"^  (-\S.*?)(?:\s{2,}|$)")


def subcommands() -> frozenset[str]:
    """The subcommands `tandem`'s argparse registers (listed without importing them)."""
    parser = cli.build_parser([])
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert actions, "tandem's parser has no subcommands"
    return frozenset(actions[0].choices)


@functools.cache
def accepted_flags(subcommand: str) -> frozenset[str]:
    """The long options in `tandem SUBCOMMAND --help` (their definition lines only)."""
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", subcommand, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"tandem {subcommand} --help failed:\n{result.stderr}"
    flags = set()
    for line in result.stdout.splitlines():
        match = OPTION_LINE.match(line)
        if match:
            flags.update(FLAG.findall(match.group(1)))
    assert "--help" in flags, f"could not parse `tandem {subcommand} --help`"
    return frozenset(flags)


def _arguments(text: str, start: int, end: int) -> tuple[list[str], list[str]]:
    """The flags of one command's arguments: (its own, those after a bare `--`)."""
    stop = END_OF_COMMAND.search(text, start, end)
    tokens = text[start : stop.start() if stop else end].split()
    own: list[str] = []
    passed: list[str] = []
    target = own
    for token in tokens:
        if token.strip("[]()") == "--":
            target = passed
            continue
        target.extend(FLAG.findall(token))
    return own, passed


def command_problems(code: Code, known: frozenset[str]) -> list[str]:
    problems = []
    matches = list(TANDEM_COMMAND.finditer(code.text))
    for i, match in enumerate(matches):
        name = match.group(1)
        if name not in known:
            problems.append(
                f"{code.where()}: `tandem {name}` is not a subcommand ({code.text.strip()})"
            )
            continue
        end = matches[i + 1].start() if i + 1 < len(matches) else len(code.text)
        own, passed = _arguments(code.text, match.end(), end)
        # `tandem serve ... -- FLAGS` hands FLAGS to every engine.
        checks = [(name, own), ("engine" if name == "serve" else name, passed)]
        for subcommand, flags in checks:
            for flag in flags:
                if flag not in accepted_flags(subcommand):
                    problems.append(
                        f"{code.where()}: `tandem {subcommand}` has no {flag} ({code.text.strip()})"
                    )
    return problems


def test_tandem_commands_and_flags_exist() -> None:
    known = subcommands()
    assert {"serve", "engine", "frontend"} <= known, f"subcommands found: {sorted(known)}"
    problems = [
        p
        for path in doc_files()
        for code in parse(path).code
        for p in command_problems(code, known)
    ]
    assert not problems, (
        f"commands the CLI does not accept (subcommands: {', '.join(sorted(known))}):\n  "
        + "\n  ".join(problems)
    )


# ---------------------------------------------------------------------------- installs

PIP_INSTALL = re.compile(r"\bpip3?\s+install\b")
REQUIREMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
OLD_EXTRAS = re.compile(r"(?<![\w.-])tandem\[")  # `tandem[engine]`: the extras under another name


def distribution_name() -> str:
    """pyproject.toml's [project] name, normalized as the package index compares names."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        name = tomllib.load(f)["project"]["name"]
    return _normalized(name)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_problems(code: Code, project: str) -> tuple[list[str], int]:
    """Installs of this project (a requirement named tandem or tandem-*) under a name
    other than ``project``, and how many installs of the project the code holds."""
    problems, found = [], 0
    for match in PIP_INSTALL.finditer(code.text):
        stop = END_OF_COMMAND.search(code.text, match.end())
        for token in code.text[match.end() : stop.start() if stop else len(code.text)].split():
            name = REQUIREMENT_NAME.match(token.strip("'\""))
            if token.startswith("-") or name is None:
                continue
            normalized = _normalized(name.group(0))
            if normalized == "tandem" or normalized.startswith("tandem-"):
                found += 1
                if normalized != project:
                    problems.append(f"{code.where()}: installs {name.group(0)!r}, not {project!r} ({code.text.strip()})")
    if OLD_EXTRAS.search(code.text):
        problems.append(f"{code.where()}: names the extras as tandem[...], not {project}[...] ({code.text.strip()})")
    return problems, found


def test_pip_install_names_the_distribution() -> None:
    """`pip install` of the project, in every doc, names pyproject's [project] name (the
    name `tandem` on the package index is another project's)."""
    project = distribution_name()
    problems, found = [], 0
    for path in [*doc_files(), ROOT / "deploy" / "README.md"]:
        for code in parse(path).code:
            more, count = install_problems(code, project)
            problems += more
            found += count
    assert not problems, "installs under another name:\n  " + "\n  ".join(problems)
    assert found, f"no doc says `pip install {project}`"
    assert project == _normalized(cli.DISTRIBUTION), "tandem --version looks up another distribution than pyproject names"


# ---------------------------------------------------------------------------- the OpenAI API

ENDPOINT = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)`")


def documented_endpoints() -> set[tuple[str, str]]:
    """(method, path) of every row of docs/openai-api.md's endpoint table."""
    rows = [line for line in (DOCS_DIR / "openai-api.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")]
    return {m.groups() for row in rows for m in ENDPOINT.finditer(row.split("|")[1])}


def test_the_openai_endpoint_table_lists_every_route() -> None:
    """The table in docs/openai-api.md and the routes build_app registers are the same."""
    from fastapi.routing import APIRoute

    from frontend_service.openai.app import FrontendView, build_app

    app = build_app(FrontendView(servicer=None, model_path="", ready=lambda: False))
    routes = {(method, r.path) for r in app.routes if isinstance(r, APIRoute) for method in r.methods}
    documented = documented_endpoints()
    assert routes, "build_app registered no route"
    assert routes - documented == set(), "routes missing from docs/openai-api.md's table"
    assert documented - routes == set(), "docs/openai-api.md lists endpoints the app does not serve"
