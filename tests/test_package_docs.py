"""The package installs the operator docs where the journal catalog's ``Support:`` sends the
reader (/usr/share/doc/ds-ops), with the links between the pages still working there.

debhelper's own dh_installdocs and dh_compress run (the latter as debian/rules overrides it) on a
copy of the files they read, into a staging tree, as ``make deb`` runs them; building the .deb
itself takes minutes (tests/e2e covers that)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from test_docs import broken_links

DOC_DIR = "usr/share/doc/ds-ops"


def _support_paths() -> set[str]:
    text = (REPO / "debian" / "ds-ops.catalog").read_text(encoding="utf-8")
    return {p.strip() for line in re.findall(r"^Support:(.*)$", text, re.M) for p in line.split(",")}


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """Run dh_installdocs and debian/rules' dh_compress on a copy of what they read; return the
    staging tree (debian/ds-ops)."""
    if shutil.which("dh_installdocs") is None:
        pytest.skip("debhelper is not installed (scripts/install-build-deps.sh --deb)")
    work = tmp_path_factory.mktemp("pkg")
    shutil.copytree(REPO / "debian", work / "debian")
    for line in (REPO / "debian" / "ds-ops.docs").read_text().split():
        src = REPO / line
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, work / line)
    rules = (REPO / "debian" / "rules").read_text()

    def as_rules_runs(tool: str) -> list[str]:  # dh's sequence runs an override_<tool> instead
        override = re.search(rf"^override_{tool}:\n\t(.+)$", rules, re.M)
        return [*(shlex.split(override.group(1)) if override else [tool]), "-pds-ops"]

    for step in (as_rules_runs("dh_installdocs"), as_rules_runs("dh_installchangelogs"), as_rules_runs("dh_compress")):
        done = subprocess.run(step, cwd=work, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{step}: {done.stderr}"
    return work / "debian" / "ds-ops"


def test_the_catalog_sends_readers_to_the_man_page_and_the_package_docs():
    assert _support_paths() == {"man:ds-ops(1)", f"/{DOC_DIR}"}


def test_the_package_docs_dir_holds_the_operator_docs_and_the_changelog(staged):
    doc = staged / DOC_DIR
    for page in ("README.md", "CHANGELOG.md", "docs/README.md", "docs/INSTALL.md", "docs/operating.md",
                 "docs/alerts.md", "docs/trust.md", "docs/report-example.png"):
        assert (doc / page).is_file(), f"/{DOC_DIR}/{page} is not installed"
    assert not [p for p in doc.rglob("*.gz") if p.name != "changelog.gz"], \
        "a file was compressed: the links to it would no longer resolve"
    # the Debian changelog beside it, not replaced by CHANGELOG.md (a native package's dh_installchangelogs)
    assert (doc / "changelog.gz").is_file()
    assert subprocess.run(["zcat", str(doc / "changelog.gz")], capture_output=True, text=True,
                          check=True).stdout.startswith("ds-ops (")


def test_the_links_between_the_installed_pages_resolve_where_they_are_installed(staged, monkeypatch):
    import test_docs

    doc = staged / DOC_DIR
    monkeypatch.setattr(test_docs, "REPO", doc)
    pages = sorted(doc.rglob("*.md"))
    assert len(pages) >= 15
    # links into the source tree (../opt_ds_ops/..., ../debian/ds-ops.1) are for readers of the
    # repository; every link from one page to another must hold in the package too
    installed = tuple((REPO / "debian" / "ds-ops.docs").read_text().split())

    def between_pages(problem: str) -> bool:
        missing = re.search(r": no such file (\S+)$", problem)
        return missing is None or missing.group(1).startswith(installed)

    broken = [f"{p.relative_to(doc)}: {b}" for p in pages for b in broken_links(p)
              if "outside the repository" not in b and between_pages(b)]
    assert broken == []
