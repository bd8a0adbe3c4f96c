"""What the README tells a new user, held to the code it describes."""

import os
import re

from conftest import REPO
from dsv4_sm80.gate.report import RELEASES

README = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
PYPROJECT = open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8").read()


def test_one_name_per_checkpoint():
    assert set(re.findall(r"deepseek-ai/[\w.-]+", README)) == set(RELEASES)


def test_the_commands_it_shows_exist():
    assert "python -m pytest -q -n 2 --dist loadfile" in README
    assert "python -m pytest -q -n 2 --dist loadfile" in open(os.path.join(REPO, ".ci", "run")).read()
    assert 'dsv4-sm80 = "dsv4_sm80.cli:main"' in PYPROJECT and "dsv4-sm80 doctor" in README
    assert "source .venv/bin/activate" in README and "curl " in README
    for term in ("DSPARK", "mHC", "SWA, C4, C128", "seam", "gate", "lab mode"):
        assert f"**{term}" in README, term


def test_the_license_is_an_spdx_expression():
    """PEP 639: an SPDX expression and the license file, no table form and no License classifier (setuptools
    deprecates both)."""
    assert re.search(r'^license = "Apache-2.0"$', PYPROJECT, re.M) and 'license-files = ["LICENSE"]' in PYPROJECT
    assert "License ::" not in PYPROJECT
