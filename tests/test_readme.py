"""The README stays in step with the code."""

import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_config_reference_in_readme_matches_the_code():
    out = subprocess.run([sys.executable, "-m", "router", "config-reference"], capture_output=True, text=True,
                         check=True).stdout.strip()
    block = README.split("<!-- config-reference:start -->")[1].split("<!-- config-reference:end -->")[0].strip()
    assert block == out


def undocumented_flags(command: str) -> list[str]:
    help_text = subprocess.run([sys.executable, "-m", "router", command, "--help"], capture_output=True, text=True,
                               check=True).stdout
    flags = set(re.findall(r"(--[a-z][a-z-]+)", help_text)) - {"--help"}
    return sorted(f for f in flags if f"`{f}" not in README)


def test_every_flag_of_serve_is_documented():
    assert not undocumented_flags("serve")


def test_every_metric_is_documented():
    from router.metrics import Metrics
    names = {m.name for m in Metrics().registry.collect()}
    missing = [n for n in names if n not in README and n + "_total" not in README]
    assert not missing, missing


def test_every_flag_of_plan_is_documented():
    assert not undocumented_flags("plan")
