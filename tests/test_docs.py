"""The front door stays true: the README and docs/ link only to what exists, the README stays
short, CI runs the README's test command, and the quick start prints what the README shows."""

from __future__ import annotations

import math
import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_cli

README = REPO / "README.md"
README_MAX_BYTES = 12 * 1024
DOCS = sorted([README, *(REPO / "docs").rglob("*.md")])
DEMO_MARK = "<!-- make demo output (tests/test_docs.py) -->"

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """Given Markdown, return it without fenced code blocks and inline code spans."""
    return _CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """Given a heading's text, return GitHub's anchor for it: lower case, punctuation dropped
    (hyphens and underscores kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Given a Markdown file, return the anchors of its headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Given a Markdown file, return each relative link in it whose file, or anchor, is missing."""
    broken = []
    for target in _LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        rel = dest.relative_to(REPO).as_posix() if dest.is_relative_to(REPO) else None
        if rel is None:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file {rel}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel}")
    return broken


def test_the_readme_and_docs_pages_exist_and_the_link_check_reads_them():
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    assert {"README.md", "docs/README.md", "docs/operating.md", "docs/architecture.md"} <= names
    assert _LINK.findall(_prose(README.read_text(encoding="utf-8")))  # the README has links to check


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n## Second part: `x`\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#second-part-x) [gone](nope.md) [bad](a.md#third) `[code](nope2.md)`\n"
                    "```\n[fenced](nope3.md)\n```\n[web](https://example.org/x)\n", encoding="utf-8")
    assert broken_links(page) == ["nope.md: no such file nope.md", "a.md#third: no heading #third in a.md"]


def test_the_readme_is_at_most_12_kib():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; move detail into docs/"


def test_ci_runs_the_test_command_the_readme_gives():
    readme = README.read_text(encoding="utf-8")
    assert re.search(r"^make test\b", readme, re.M), "the README's quick start names `make test`"
    ci = [line.split("#")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert any(re.fullmatch(r"(stage \S+ )?make test", line) for line in ci), \
        ".ci/run says it runs the README's test command (maybe through its stage timer)"


def _demo_commands(models: Path, build: Path) -> list[list[str]]:
    """The ds-ops commands of the Makefile's demo target, its variables filled in."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    subst = {"$(BIN)/ds-ops": "ds-ops", "$(SMD)": "data/smd", "$(DEMO)": "machine-1-2",
             "$(MODELS)": str(models), "$(CURDIR)/build": str(build)}
    commands = []
    for line in recipe.splitlines():
        for var, value in subst.items():
            line = line.replace(var, value)
        line = line.split("||")[0]  # "|| test $$? -eq 3": score's status when rows are flagged
        args = shlex.split(line)
        assert args[0] == "ds-ops" and "$(" not in line, line
        commands.append(args[1:])
    return commands


def _readme_demo_block() -> list[str]:
    text = README.read_text(encoding="utf-8")
    assert DEMO_MARK in text, "the README marks its make demo output block"
    block = re.search(r"```\n(.*?)```", text[text.index(DEMO_MARK):], re.S).group(1)
    return block.splitlines()


def _normal(line: str, build: str) -> str:
    line = line.replace(build, "<build>")
    line = re.sub(r"[\d,]+ samples/s", "N samples/s", line)
    return re.sub(r"\d{8}T\d{6}\.\d{6}Z", "VERSION", line)


def _same(shown: str, printed: str) -> bool:
    """The same line, its numbers equal within float noise (2 %, or 1 for small counts). A top
    metric with a share of 2 % or less is a near tie whose column changes with the machine's float
    rounding (column 28 or 11 at 2 %): only its share is compared."""
    num = r"-?\d+(?:\.\d+)?"
    shown, printed = (re.sub(r"column \d+ ([0-2]%)", r"column ? \1", x) for x in (shown, printed))
    if re.sub(num, "#", shown) != re.sub(num, "#", printed):
        return False
    return all(math.isclose(float(a), float(b), rel_tol=0.02, abs_tol=1.0)
               for a, b in zip(re.findall(num, shown), re.findall(num, printed)))


def _has_nvidia_driver() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_has_nvidia_driver(), reason="the README shows make demo on a machine without an NVIDIA driver")
def test_the_quick_start_output_is_what_make_demo_prints(tmp_path):
    printed = []
    for args in _demo_commands(tmp_path / "models", tmp_path):
        done = run_cli(*args, shipped_defaults=True, timeout=900)  # trains to a plateau: minutes
        assert done.returncode == (3 if args[0] == "score" else 0), done.stderr  # 3: rows flagged
        printed += [_normal(line, str(tmp_path)) for line in done.stdout.splitlines()]
    shown = [_normal(line, "/root/ds-ops/build") for line in _readme_demo_block()]
    # "..." in the README stands for lines cut; every other line must be printed, in order and
    # next to its neighbours, from the first line of output to the last.
    parts, part = [], []
    for line in shown + ["..."]:
        if line.strip() == "...":
            parts.append(part)
            part = []
        else:
            part.append(line)
    at = 0
    for i, part in enumerate(parts):
        if not part:
            continue
        starts = [k for k in range(at, len(printed) - len(part) + 1)
                  if all(_same(s, p) for s, p in zip(part, printed[k:k + len(part)]))]
        assert starts and (i > 0 or starts[0] == 0), f"README lines not printed (in order):\n{part}\n\nprinted:\n" + "\n".join(printed)
        at = starts[0] + len(part)
    if parts[-1]:
        assert at == len(printed), "make demo prints lines the README neither shows nor cuts with ...:\n" + "\n".join(printed[at:])
