"""Where the tests find the repository and their data, wherever in tests/ a test module is."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository, which is the dtfm package
DATA = TESTS / "data"
