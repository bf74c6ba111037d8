"""What a user installs: metadata, version, LICENSE, and an sdist that leaves the tests out.

The sdist and wheel are built from a copy of the project's files with the setuptools this
interpreter has (the `test` extra requires >= 77, which reads the SPDX license), so nothing
is downloaded and the working tree is not touched.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import haloshard

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
# what the sdist copy needs, and tests/ so that leaving it out is checked
FILES = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in")
DIRS = ("src", "tests")


def _extra(name: str, package: str) -> SpecifierSet:
    [req] = [r for r in PROJECT["optional-dependencies"][name] if r.startswith(package)]
    return SpecifierSet(req[len(package):])


def test_version_is_one_string() -> None:
    assert Version(haloshard.__version__)  # PEP 440
    assert PROJECT["dynamic"] == ["version"] and "version" not in PROJECT
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "haloshard.__version__"


def test_license_and_classifiers() -> None:
    assert PROJECT["license"] == "BSD-3-Clause"  # an SPDX expression, not the table form
    assert PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]
    classifiers = PROJECT["classifiers"]
    # setuptools rejects License classifiers beside a license expression
    assert classifiers and not [c for c in classifiers if c.startswith("License ::")]
    # no [project.urls] until the project has a public home: an invented address misleads
    assert "urls" not in PROJECT


def test_diffusers_extra_admits_a_range_tested_on_the_pin() -> None:
    users, tests = _extra("diffusers", "diffusers"), _extra("test", "diffusers")
    pinned = Version("0.42.1")
    assert str(tests) == "==0.42.1", "CI runs one pinned diffusers"
    assert pinned in users and Version("0.42.9") in users and Version("0.43.0") not in users


def _build(tmp_path: Path, hook: str) -> Path:
    src = tmp_path / "project"
    src.mkdir()
    for name in FILES:
        shutil.copy(ROOT / name, src / name)
    for name in DIRS:
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path / "dist"
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def test_sdist_has_license_and_no_tests(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77")
    sdist = _build(tmp_path, "build_sdist")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    assert top == f"haloshard-{haloshard.__version__}"
    assert not [n for n in names if "/tests/" in n or n.endswith("/tests")], names
    assert f"{top}/LICENSE" in names and f"{top}/src/haloshard/__init__.py" in names
    assert "License-Expression: BSD-3-Clause" in pkg_info
    assert re.search(r"^Requires-Dist: diffusers<0\.43,>=0\.42\.1; extra == \"diffusers\"$",
                     pkg_info, flags=re.MULTILINE), pkg_info


def test_wheel_metadata(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77")
    wheel = _build(tmp_path, "build_wheel")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = f"haloshard-{haloshard.__version__}.dist-info"
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "haloshard/py.typed" in names  # PEP 561: type checkers read the package's hints
    assert f"Version: {haloshard.__version__}" in metadata
    assert not [n for n in names if n.startswith("tests/")]
