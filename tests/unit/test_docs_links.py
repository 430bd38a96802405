"""The docs are inside the repository: nothing cites the original design document that lives outside it
("DESIGN §n", "../shared"), every citation `docs/X.md, "Section"` names a heading (or a bold lead-in) that
exists in that file, and every markdown link between the docs (`[text](FILE.md#anchor)`) lands on a file and
a heading that exist. Reads the tracked files only (git ls-files); no network, well under a second."""
from __future__ import annotations

import re
import subprocess
import unicodedata
from functools import cache, lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".txt", ".sh", ".yaml", ".yml", ".json", ".html"}
TEXT_NAMES = {"Makefile", "run"}
# docs/benchmarks/history.md keeps the lab notebook as it was written; it may quote the old design's numbering.
HISTORY = ("docs/benchmarks/",)
THIS_FILE = "tests/unit/test_docs_links.py"


@lru_cache(maxsize=1)
def tracked_files() -> tuple[str, ...]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:  # an unpacked sdist: no history to read the tracked set from
        pytest.skip(f"not a git checkout ({e})")
    names = [n for n in out.decode().split("\0") if n]
    return tuple(n for n in names
                 if (Path(n).suffix in TEXT_SUFFIXES or Path(n).name in TEXT_NAMES) and (ROOT / n).is_file())


def read(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8", errors="replace")


def headings(md: str) -> list[str]:
    """ATX headings outside fenced code blocks (a `# comment` in a shell block is not a heading)."""
    out, fence = [], None
    for line in md.split("\n"):
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if m:
            if fence is None:
                fence = m.group(1)[0]
            elif m.group(1)[0] == fence:
                fence = None
            continue
        if fence is None:
            h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if h:
                out.append(h.group(1))
    return out


def plain(text: str) -> str:
    """A heading or a citation as a reader sees it: no backticks or emphasis, single spaces, no final dot."""
    text = re.sub(r"[`*]", "", text)
    return re.sub(r"\s+", " ", text).strip().rstrip(".:").strip()


def slug(heading: str) -> str:
    """GitHub's heading anchor: lowercase, keep letters, marks, digits, '_', '-' and spaces; spaces become '-'."""
    keep = "".join(c for c in heading.lower()
                   if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc")
    return keep.replace(" ", "-")


@cache
def anchors(rel: str) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(read(rel)):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


@cache
def section_names(rel: str) -> tuple[str, ...]:
    """What a citation may name: a heading, or a bold lead-in (`**The dial-back.**`) that opens a paragraph."""
    md = read(rel)
    bold = re.findall(r"(?m)^(?:[-*]\s+)?\*\*([^*\n]{3,120}?)\*\*", md)
    return tuple(plain(x) for x in headings(md) + bold)


def resolves(section: str, rel: str) -> bool:
    """A citation names a section by its heading, or by the heading's start up to a word boundary
    ("Broadcast" for "Broadcast (origin-only vs relay ...)", "Signed requests" for "Signed requests (run-bound,
    v2)")."""
    want = plain(section).lower()
    for name in section_names(rel):
        name = name.lower()
        if name == want or (name.startswith(want) and not name[len(want)].isalnum()):
            return True
    return False


# `docs/PROTOCOL.md, "Signed requests"`, `docs/P2P.md "Reachability"`, `BENCHMARKS.md ("Learning")`; a citation may
# wrap across lines (and across `#` / `//` comment markers), which `flatten` joins back.
CITATION = re.compile(r"\b((?:docs/)?(?:benchmarks/)?[A-Z][A-Za-z0-9_]*\.md)(?:,\s*|\s+\(?|\s*\()\"([^\"\n]{2,200})\"")
LINK = re.compile(r"\]\(([^)\s]*?\.md)?(#[^)\s]*)?\)")


def flatten(text: str) -> str:
    return re.sub(r"\n[ \t]*(?:#+|//|\*)?[ \t]*", " ", text)


def resolve_doc(name: str, cited_from: str) -> str | None:
    """The tracked doc a citation names: as written from the repository root, else relative to the citing file."""
    names = set(tracked_files())
    for cand in (name, f"docs/{name}", str(Path(cited_from).parent / name)):
        if cand in names:
            return cand
    return None


def test_nothing_cites_the_design_document_outside_the_repository():
    bad = []
    for rel in tracked_files():
        if rel.startswith(HISTORY) or rel == THIS_FILE:
            continue
        for i, line in enumerate(read(rel).split("\n"), 1):
            if "DESIGN §" in line or "DESIGN.md" in line or "../shared" in line:
                bad.append(f"{rel}:{i}: {line.strip()[:120]}")
    assert not bad, "cite the section of docs/*.md that states the contract instead:\n" + "\n".join(bad)


def test_every_section_citation_names_a_heading_that_exists():
    bad, checked = [], 0
    for rel in tracked_files():
        if rel == THIS_FILE:
            continue
        text = read(rel)
        if ".md" not in text:
            continue
        for m in CITATION.finditer(flatten(text)):
            doc = resolve_doc(m.group(1), rel)
            if doc is None:
                bad.append(f"{rel}: {m.group(0)!r}: no such document")
                continue
            checked += 1
            if not resolves(m.group(2), doc):
                bad.append(f"{rel}: {m.group(0)!r}: no heading of {doc} starts with that")
    assert checked >= 40, f"only {checked} citations found: is the pattern still right?"
    assert not bad, "\n".join(bad)


def test_every_markdown_link_between_the_docs_resolves():
    bad, checked = [], 0
    for rel in tracked_files():
        if not rel.endswith(".md"):
            continue
        for m in LINK.finditer(re.sub(r"<!--.*?-->", "", read(rel), flags=re.DOTALL)):  # not HTML comments
            target, frag = m.group(1), m.group(2)
            if target is None and frag is None:
                continue
            if target and re.match(r"^[a-z]+://", target):
                continue
            doc = rel if target is None else str((Path(rel).parent / target).resolve().relative_to(ROOT))
            checked += 1
            if not (ROOT / doc).is_file():
                bad.append(f"{rel}: {m.group(0)}: no file {doc}")
            elif frag and frag[1:] not in anchors(doc):
                bad.append(f"{rel}: {m.group(0)}: no heading with anchor {frag} in {doc}")
    assert checked >= 16, f"only {checked} links found"
    assert not bad, "\n".join(bad)


def test_benchmarks_open_with_one_headline_table_whose_rows_link_and_say_how_to_reproduce():
    md = read("docs/BENCHMARKS.md")
    assert headings(md)[1] == "Headline figures", "the headline table comes first"
    table = md.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.split("\n") if r.startswith("|") and not r.startswith("|---")]
    header, body = rows[0], rows[1:]
    assert "section" in header and "reproduce" in header, header
    assert len(body) >= 10
    for row in body:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert re.search(r"\]\([^)]*#[^)]+\)", cells[-2]), f"no section link: {row[:100]}"
        assert "`" in cells[-1], f"no script or command: {row[:100]}"


@pytest.mark.parametrize("heading,anchor", [
    ("Broadcast (origin-only vs relay vs libp2p swarm vs shardcast)",
     "broadcast-origin-only-vs-relay-vs-libp2p-swarm-vs-shardcast"),
    ("WAN lab: does k = 2 hide the broadcast? (`bench/wan_k.py`)", "wan-lab-does-k--2-hide-the-broadcast-benchwan_kpy"),
    ("Swarm simulation (N = 16 … 4,000 on internet links)", "swarm-simulation-n--16--4000-on-internet-links"),
])
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor
