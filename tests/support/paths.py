"""Where things are: the repository, its deploy/ folder, the test fixtures."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
FIXTURES = ROOT / "tests" / "fixtures"
