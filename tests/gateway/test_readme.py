"""The README and docs/ stay in step with the code, and every link in them leads somewhere."""

import re
import subprocess
import sys
from pathlib import Path
from support.paths import ROOT

README = (ROOT / "README.md").read_text()
PAGES = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
EVERYTHING = "\n".join(PAGES.values())
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_config_reference_in_the_docs_matches_the_code():
    out = subprocess.run([sys.executable, "-m", "router", "config-reference"], capture_output=True, text=True,
                         check=True).stdout.strip()
    page = (ROOT / "docs" / "configuration.md").read_text()
    block = page.split("<!-- config-reference:start -->")[1].split("<!-- config-reference:end -->")[0].strip()
    assert block == out


def undocumented_flags(command: str) -> list[str]:
    help_text = subprocess.run([sys.executable, "-m", "router", command, "--help"], capture_output=True, text=True,
                               check=True).stdout
    flags = set(re.findall(r"(--[a-z][a-z-]+)", help_text)) - {"--help"}
    return sorted(f for f in flags if f"`{f}" not in EVERYTHING)


def test_every_flag_of_serve_is_documented():
    assert not undocumented_flags("serve")


def test_every_flag_of_plan_is_documented():
    assert not undocumented_flags("plan")


def test_every_metric_is_documented():
    from router.metrics import Metrics
    page = (ROOT / "docs" / "metrics.md").read_text()
    names = {m.name for m in Metrics().registry.collect()}
    missing = [n for n in names if n not in page and n + "_total" not in page]
    assert not missing, missing


def slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule: lower case, punctuation dropped)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: str) -> set[str]:
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", page, flags=re.M)}


def test_every_relative_link_and_anchor_leads_somewhere():
    broken = []
    for path, text in PAGES.items():
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not followed here
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append((path.name, target))
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append((path.name, target))
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(README) if t.startswith("docs/")}
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_the_readme_is_the_first_screen_not_the_manual():
    assert len(README.splitlines()) <= 300
    for command in ("./deploy/run-local.sh", "./tests/run.sh"):
        assert f"```sh\n{command}\n```" in README
