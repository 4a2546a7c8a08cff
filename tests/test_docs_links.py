"""The README and the guide link only to what exists: every relative link of README.md and docs/**/*.md names
a file of the repository, and an anchor (`page.md#heading`) names a heading of that page as GitHub slugs it
(lower case, punctuation dropped, spaces to hyphens, a repeated heading numbered)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def slugs(page: Path) -> set[str]:
    out, seen = set(), {}
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)   # a `# comment` in a block is no heading
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_and_a_heading_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in slugs(file):
            bad.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert bad == [], bad
