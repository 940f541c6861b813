"""What the repository tracks must work on a machine that never saw it.

The oracle is git's own index: a tracked symbolic link (mode 120000) points into the machine it
was made on; a file under a virtual-environment or build folder is that machine's output; text
naming an absolute home or work path of a build machine does not exist on a fresh clone.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Path parts that only a build or an install makes: none of them belongs in the repository.
GENERATED_PARTS = frozenset(
    {".venv", ".venv-peers", "venv", "site-packages", "build", "dist", "__pycache__", ".eggs"}
)
# Absolute paths of a developer's or CI's machine (a home, the work tree, a worktree of it).
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|Users|root)/[\w.-]+")


def _index() -> list[tuple[str, str]]:
    """(mode, path) of every tracked file, or skip where this is no git checkout."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout (an installed or unpacked copy)")
    out = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "ls-files", "-s", "-z"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    entries = []
    for record in filter(None, out.split("\0")):
        meta, path = record.split("\t", 1)
        entries.append((meta.split()[0], path))
    return entries


def test_no_tracked_symbolic_link() -> None:
    links = [path for mode, path in _index() if mode == "120000"]
    assert links == [], f"tracked symbolic links (they point into one machine): {links}"


def test_no_tracked_file_under_a_generated_folder() -> None:
    generated = [
        path
        for _, path in _index()
        if GENERATED_PARTS.intersection(Path(path).parts[:-1])
        or path.endswith((".so", ".pyc", ".o"))
    ]
    assert generated == [], f"tracked build or environment output: {generated}"


def test_no_text_names_a_build_machine_path() -> None:
    hits = []
    for mode, path in _index():
        if mode == "120000":
            continue
        data = (REPO_ROOT / path).read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (a plot): no path a reader could follow
        for lineno, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                hits.append(f"{path}:{lineno}: {line.strip()[:100]}")
    assert hits == [], "absolute paths of a build machine:\n" + "\n".join(hits)


def test_ignore_patterns_match_links_as_well_as_folders() -> None:
    # ``.venv-peers/`` in .gitignore matches a folder only; a link of that name slipped through.
    for name in (".venv", ".venv-peers", "build"):
        probe = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "check-ignore", "--no-index", "-q", name],
            check=False,
        )
        assert probe.returncode == 0, f"{name} (a file or a link) is not ignored"


def test_the_guard_itself_sees_a_link() -> None:
    # The pattern and the mode test must catch what they are for, or the tests above cannot fail.
    root = "/" + "work"  # spelled apart, or this very line would be a hit
    assert MACHINE_PATH.search(f"ln -s {root}/wt-x/.venv-peers")
    assert not MACHINE_PATH.search("shm segments live in /dev/shm/ubep-x")
    assert GENERATED_PARTS.intersection(Path("src/ubep/dist/engine.py").parts[:-1])


# A Markdown link target: `[text](target)`, the target up to a space, `)` or `#`.
MD_LINK = re.compile(r"\]\(([^)\s#]+)[^)]*\)")
# A path that leaves the clone (a sibling checkout of the sources the docs were written from).
OUTSIDE_PATH = re.compile(r"(?:\.\./)+shared\b|\bshared/(?:docs|paper)/")


def _broken_links(doc: Path, root: Path) -> list[str]:
    """Links of ``doc`` that a reader of a clone under ``root`` cannot follow: a web address
    (the repository speaks for itself), or a relative path that does not exist in the clone."""
    out = []
    for target in MD_LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            out.append(target)
            continue
        resolved = (doc.parent / target).resolve()
        if not resolved.is_relative_to(root) or not resolved.exists():
            out.append(target)
    return out


def test_every_doc_link_stays_inside_the_clone() -> None:
    broken = []
    for _, path in _index():
        if path.endswith(".md"):
            broken += [f"{path}: {t}" for t in _broken_links(REPO_ROOT / path, REPO_ROOT)]
    assert broken == [], "links a clone cannot follow:\n" + "\n".join(broken)


def test_no_text_points_outside_the_clone() -> None:
    hits = []
    for mode, path in _index():
        if mode == "120000" or path == "tests/test_repo_hygiene.py":
            continue
        text = (REPO_ROOT / path).read_bytes().decode("utf-8", "replace")
        hits += [f"{path}:{n}" for n, line in enumerate(text.splitlines(), 1)
                 if OUTSIDE_PATH.search(line)]
    assert hits == [], f"paths outside the clone: {hits}"


def test_the_link_guard_sees_a_broken_and_an_outside_link(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text("x\n")
    doc = tmp_path / "README.md"
    doc.write_text("[a](docs/A.md#s) [b](docs/B.md) [c](../x/C.md) [d](https://example.org)\n")
    assert _broken_links(doc, tmp_path) == ["docs/B.md", "../x/C.md", "https://example.org"]
    assert OUTSIDE_PATH.search("see ../shared/docs/X.md") and not OUTSIDE_PATH.search("shm")


README_MAX_LINES = 250  # what ubep is, the two commands, one complete program per face, links


def test_the_readme_stays_a_front_page() -> None:
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    assert any("Quick start" in line for line in lines)


SYS_PATH = re.compile(r"\bsys\s*\.\s*path\b")


def _sys_path_users(root: Path) -> list[str]:
    """Files under ``root`` that name ``sys.path``: a module found through an edited search
    path is one the package's imports (and this suite's import graph) cannot see."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                  if SYS_PATH.search(p.read_text(errors="replace")))


def test_no_source_edits_the_import_path() -> None:
    assert _sys_path_users(REPO_ROOT / "src") == []


def test_the_import_path_guard_sees_an_edit(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import sys\nsys.path.insert(0, 'x')\n")
    (tmp_path / "b.py").write_text("import sys\nprint(sys.argv)\n")
    assert _sys_path_users(tmp_path) == ["a.py"]
