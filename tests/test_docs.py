"""The pages: every relative link of README.md and docs/ names a file that exists, every plot
under docs/ is shown (a markdown image) on a page, and the README stays short and runs the test
command CI runs."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# [text](target) and ![alt](target), with an optional "title"; code blocks are left out.
LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_BLOCK = re.compile(r"```.*?```", flags=re.DOTALL)


def links() -> list[tuple[Path, bool, str, Path]]:
    """(page, is an image, target as written, the path it names) of each relative link."""
    found = []
    for page in PAGES:
        for image, target in LINK.findall(CODE_BLOCK.sub("", page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor on the same page
            path = (page.parent / target.split("#")[0]).resolve()
            found.append((page, bool(image), target, path))
    return found


def test_every_relative_link_exists():
    broken = [
        f"{page.relative_to(REPO)}: {target}"
        for page, _, target, path in links()
        if not path.exists()
    ]
    assert not broken, broken


def test_every_plot_is_shown_on_a_page():
    shown = {path for _, image, _, path in links() if image}
    plots = sorted((REPO / "docs").rglob("*.png"))
    assert plots
    unshown = [str(p.relative_to(REPO)) for p in plots if p.resolve() not in shown]
    assert not unshown, f"plots no page shows as an image: {unshown}"


def test_the_link_pattern_reads_links_and_images():
    text = '[a](x.md) ![b](y.png "t") [c](https://e.org) [d](#s) ```\n[e](z.md)\n```'
    found = [(i, t) for i, t in LINK.findall(CODE_BLOCK.sub("", text))]
    assert found == [("", "x.md"), ("!", "y.png"), ("", "https://e.org"), ("", "#s")]


def test_the_readme_is_short_and_ci_runs_its_test_command():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "\npython3 -m pytest tests -q\n" in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert 'python3 -m pytest "$@" -q' in ci and "suite tests || rc=$?" in ci
