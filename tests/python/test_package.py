"""The installed package: one version everywhere, and the CLI the wheel ships."""

import os
import re
import subprocess
import sys

import pytest

import refit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project_version() -> str:
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        return re.search(r"project\(refit VERSION ([0-9.]+)", f.read()).group(1)


def test_version_is_the_projects():
    assert refit.__version__ == project_version()
    assert isinstance(refit.__wire_version__, int) and refit.__wire_version__ >= 1


def test_changelog_names_this_version():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        assert f"## {refit.__version__} " in f.read()


@pytest.mark.skipif(refit.cli_path() is None, reason="a build tree's package: no bundled CLI")
def test_bundled_cli_and_python_m_refit():
    want = f"refit {refit.__version__} (wire protocol {refit.__wire_version__},"
    direct = subprocess.run([refit.cli_path(), "--version"], capture_output=True, text=True,
                            timeout=60)
    assert direct.returncode == 0 and direct.stdout.startswith(want), direct
    module = subprocess.run([sys.executable, "-m", "refit", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert module.returncode == 0 and module.stdout.startswith(want), module
    # A real command through `python -m refit`: the support matrix.
    matrix = subprocess.run([sys.executable, "-m", "refit", "matrix"], capture_output=True,
                            text=True, timeout=60)
    assert matrix.returncode == 0 and "fsdp2" in matrix.stdout, matrix
    # The console script sits next to the interpreter.
    script = os.path.join(os.path.dirname(sys.executable), "refit")
    if os.path.exists(script):
        out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith(want), out


def test_installed_when_expected():
    if os.environ.get("REFIT_EXPECT_INSTALLED") != "1":
        pytest.skip("not run against an installed package")
    assert os.path.realpath(refit.__file__).startswith(os.path.realpath(sys.prefix) + os.sep)
    assert refit.cli_path() is not None
