"""README.md and docs/*.md name only what the repository has.

Every relative Markdown link (and its #anchor, when it points into a Markdown file), every
command that runs a repository file (`python benchmarks/x.py`, `python -m bunshinrl.demo`,
`bash scripts/setup.sh`, `pytest tests/...`), every `make` target, and every path in inline code
that starts with one of the repository's folders must exist. Pure: reads files only.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("benchmarks", "bunshinfork", "bunshinrl", "criu", "csrc", "docs", "examples", "kernel", "scripts", "tests",
       ".ci")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
PYTHONS = {"python", "python3", ".venv/bin/python", "$(PY)"}
MAKE_TARGET = re.compile(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", re.M)


@dataclass(frozen=True)
class Ref:
    doc: Path
    line: int
    text: str  # what names the file, as written

    def __str__(self) -> str:
        return f"{self.doc.name}:{self.line}: {self.text}"


def make_targets(makefile: Path) -> set[str]:
    return set(MAKE_TARGET.findall(makefile.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", md.read_text()), re.M):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def links(doc: Path, root: Path = ROOT) -> list[tuple[Ref, str]]:
    """(reference, the problem) for every broken relative link in `doc`."""
    text = doc.read_text()
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    bad = []
    for m in LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        ref = Ref(doc, _line(prose, m.start()), target)
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append((ref, "no such file"))
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append((ref, f"no heading #{anchor} in {dest.relative_to(root)}"))
    return bad


def _repo_path(word: str) -> str | None:
    word = word.removeprefix("$PWD/").removeprefix("$(CURDIR)/").removeprefix("./").rstrip(".,;:)")
    if "/" not in word or word.split("/")[0] not in TOP or any(c in word for c in "*{}<>$"):
        return None
    return word


def _exists(path: str, root: Path) -> bool:
    # A prefix names a family of files (criu/patches/0001 for 0001-dump-....patch).
    p = root / path
    return p.exists() or any(p.parent.glob(p.name + "*"))


def commands(doc: Path, targets: set[str], root: Path = ROOT) -> list[tuple[Ref, str]]:
    """(reference, the problem) for every command or inline path in `doc` naming a missing file."""
    text = doc.read_text()
    bad = []
    spans: list[tuple[int, str]] = []  # (position, a line of a code block or an inline code span)
    for block in FENCE.finditer(text):
        lines = block.group(0).split("\n")[1:-1]
        pos = block.start() + len(block.group(0).split("\n")[0]) + 1
        for ln in lines:
            spans.append((pos, ln))
            pos += len(ln) + 1
    prose = FENCE.sub(lambda m: " " * len(m.group(0)), text)
    spans += [(m.start(), " ".join(m.group(1).split())) for m in CODE.finditer(prose)]
    for pos, span in spans:
        line = _line(text, pos)
        for cmd in re.split(r"&&|;|\|\|?|\$\(", span.split(" # ")[0].lstrip("#$ ")):
            try:
                words = shlex.split(cmd, comments=True)
            except ValueError:
                words = cmd.split()
            bad += _check_command(Ref(doc, line, cmd.strip()), words, targets, root)
    return bad


def _check_command(ref: Ref, words: list[str], targets: set[str], root: Path) -> list[tuple[Ref, str]]:
    words = [w for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]  # VAR=value prefixes
    if not words:
        return []
    prog, args = words[0], words[1:]
    bad = []
    if prog == "make":
        rest = iter(args)
        for a in rest:
            if a == "-C":
                d = next(rest, "")
                if not (root / d / "Makefile").exists():
                    bad.append((ref, f"no Makefile in {d}"))
                return bad
            if a.startswith("-") or "=" in a:
                continue
            if a not in targets:
                bad.append((ref, f"no make target {a!r}"))
        return bad
    if prog in PYTHONS and args[:1] == ["-m"] and len(args) > 1:
        mod = args[1]
        if mod.split(".")[0] in ("bunshinfork", "bunshinrl", "benchmarks", "tests", "kernel"):
            base = root / mod.replace(".", "/")
            if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()
                    or (base / "__main__.py").exists()):
                bad.append((ref, f"no module {mod}"))
        return bad
    # A command running a repository file, or a path on its own (`examples/verl/tool_config.yaml`).
    if prog in PYTHONS or prog in ("bash", "sh", "pytest") or prog.endswith("/pytest") or _repo_path(prog):
        for w in [prog, *args] if _repo_path(prog) else args:
            path = _repo_path(w.split("::")[0])
            if path and not _exists(path, root):
                bad.append((ref, f"no such file {path}"))
    return bad


# These tests read files only: the host's census and ksmd's knobs (conftest's) are not theirs to
# check, so they run without the test lock, beside tests that hold workspaces.
@pytest.fixture
def no_leaks() -> None:
    pass


@pytest.fixture(scope="module")
def ksm_knobs_restored() -> None:
    pass


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_to_files_that_exist(doc: Path) -> None:
    bad = links(doc)
    assert not bad, "\n".join(f"{r}: {why}" for r, why in bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_name_files_and_targets_that_exist(doc: Path) -> None:
    bad = commands(doc, make_targets(ROOT / "Makefile"))
    assert not bad, "\n".join(f"{r}: {why}" for r, why in bad)


def test_the_checker_finds_what_is_missing(tmp_path: Path) -> None:
    # The check itself can fail: a planted document with one of each kind of dead reference.
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "x.md"
    doc.write_text("# Title\n\n[ok](x.md#title) [gone](nothere.md) [bad anchor](x.md#nope)\n\n"
                   "`python benchmarks/no_such_bench.py --quick` and `make no-such-target`\n\n"
                   "```sh\npython -m bunshinrl.no_such_module\nbash scripts/no_such.sh\n```\n"
                   "See `examples/no/such.yaml`.\n")
    (tmp_path / "Makefile").write_text("demo:\n\ttrue\n")
    found = [why for _, why in links(doc, tmp_path)] + [
        why for _, why in commands(doc, make_targets(tmp_path / "Makefile"), tmp_path)]
    assert sorted(found) == sorted([
        "no such file", "no heading #nope in docs/x.md", "no such file benchmarks/no_such_bench.py",
        "no make target 'no-such-target'", "no module bunshinrl.no_such_module", "no such file scripts/no_such.sh",
        "no such file examples/no/such.yaml"]), found
    assert DOCS and all(d.exists() for d in DOCS)
