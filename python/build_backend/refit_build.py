"""refit's in-tree PEP 517 build backend: `pip install .` / `pip wheel .` drive CMake.

No build requirement comes from a package index: the backend uses the standard library, `cmake`
(and `ninja` when present) from the system, and the same Debian packages as scripts/build.sh
(scripts/install-deps.sh installs them). It configures its own build directory for the
interpreter that runs it, builds the extension module `refit._refit` and the `refit` CLI, and
packs them with the pure-Python package into a wheel for that interpreter:

    refit/                 the package (python/refit/*.py), its extension and refit/bin/refit
    refit-<v>.dist-info/   METADATA, WHEEL, entry_points.txt (the `refit` console script), RECORD

Settings (pip `--config-settings KEY=VALUE`, or the environment):
    build-dir   / REFIT_WHEEL_BUILD_DIR   the CMake build directory (default: build-wheel/<interpreter
                                          tag> in the source tree, configured Release for this
                                          interpreter). An existing build tree, e.g. ./build, is
                                          used as it is configured: its module must be for this
                                          Python version.
    cmake-args  / REFIT_CMAKE_ARGS        extra CMake arguments, space-separated
                                          (e.g. -DCMAKE_CUDA_ARCHITECTURES=90 or -DREFIT_ENABLE_CUDA=OFF)
    jobs        / REFIT_BUILD_JOBS        parallel build jobs (default: the machine's CPUs)
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "refit"
SUMMARY = "Push a sharded trainer's weights into inference engines after every RL step"


# ---------------------------------------------------------------------------------------------
# Facts about the project and the interpreter


def project_version() -> str:
    """The one version: project(refit VERSION x.y.z) in CMakeLists.txt."""
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        m = re.search(r"project\(\s*refit\s+VERSION\s+([0-9]+\.[0-9]+\.[0-9]+)", f.read())
    if not m:
        raise RuntimeError("refit build backend: no `project(refit VERSION x.y.z)` in CMakeLists.txt")
    return m.group(1)


def wheel_tag() -> str:
    """<python>-<abi>-<platform> of the interpreter running the build (the extension is for it)."""
    impl = {"cpython": "cp"}.get(sys.implementation.name, sys.implementation.name[:2])
    py = f"{impl}{sys.version_info.major}{sys.version_info.minor}"
    abi = py + (getattr(sys, "abiflags", "") or "")
    plat = re.sub(r"[^A-Za-z0-9_]", "_", sysconfig.get_platform())
    return f"{py}-{abi}-{plat}"


def setting(config_settings: Optional[Dict[str, str]], key: str, env: str) -> Optional[str]:
    value = (config_settings or {}).get(key)
    if value is None or value == "":
        value = os.environ.get(env)
    return value or None


def metadata_text(version: str) -> str:
    readme = ""
    try:
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            readme = f.read()
    except OSError:
        pass
    head = (
        "Metadata-Version: 2.1\n"
        f"Name: {NAME}\n"
        f"Version: {version}\n"
        f"Summary: {SUMMARY}\n"
        "Requires-Python: >=3.8\n"
        "Provides-Extra: torch\n"
        "Requires-Dist: torch; extra == \"torch\"\n"
        "Description-Content-Type: text/markdown\n"
    )
    return head + "\n" + readme


# ---------------------------------------------------------------------------------------------
# Building


def run(cmd: List[str], cwd: Optional[str] = None) -> None:
    print("refit build backend: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def cmake_build(config_settings: Optional[Dict[str, str]]) -> Tuple[str, str]:
    """Builds the extension and the CLI; returns (the package directory, the CLI binary)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("refit build backend: `cmake` not found (Debian: apt-get install cmake; "
                           "or bash scripts/install-deps.sh)")
    build_dir = setting(config_settings, "build-dir", "REFIT_WHEEL_BUILD_DIR")
    if build_dir is None:
        build_dir = os.path.join(ROOT, "build-wheel", wheel_tag().split("-")[0])
    build_dir = os.path.abspath(build_dir)
    extra = shlex.split(setting(config_settings, "cmake-args", "REFIT_CMAKE_ARGS") or "")
    if not os.path.isfile(os.path.join(build_dir, "CMakeCache.txt")):
        args = [cmake, "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                "-DREFIT_BUILD_TESTS=OFF", "-DREFIT_BUILD_PYTHON=ON",
                f"-DPython_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        run(args + extra)
    elif extra:  # an existing build tree (e.g. ./build) is used as configured, plus these
        run([cmake, "-S", ROOT, "-B", build_dir] + extra)
    jobs = setting(config_settings, "jobs", "REFIT_BUILD_JOBS") or str(os.cpu_count() or 2)
    run([cmake, "--build", build_dir, "--target", "refit_python", "refit", "-j", jobs])
    package = os.path.join(build_dir, "python", "refit")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if not os.path.isfile(os.path.join(package, "_refit" + suffix)):
        raise RuntimeError(
            f"refit build backend: CMake did not build the extension for {sys.executable} "
            f"(expected {os.path.join(package, '_refit' + suffix)}); it needs the interpreter's "
            "development headers (Debian: python3-dev) and pybind11 (Debian: pybind11-dev), and "
            "an existing build directory must have been configured for this Python version "
            "(-DPython_EXECUTABLE)")
    cli = os.path.join(build_dir, "src", "refit")
    if not os.path.isfile(cli):
        raise RuntimeError(f"refit build backend: the CLI was not built ({cli})")
    return package, cli


# ---------------------------------------------------------------------------------------------
# Wheel writing (PEP 427)


class WheelWriter:
    def __init__(self, path: str) -> None:
        self.zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.records: List[Tuple[str, str, str]] = []

    def add(self, arcname: str, data: bytes, mode: int = 0o644) -> None:
        info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = (0o100000 | mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.records.append((arcname, f"sha256={digest}", str(len(data))))

    def add_file(self, arcname: str, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        self.add(arcname, data, 0o755 if os.access(path, os.X_OK) else 0o644)

    def close(self, record_name: str) -> None:
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        for row in self.records:
            w.writerow(row)
        w.writerow((record_name, "", ""))
        self.zip.writestr(zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0)), out.getvalue())
        self.zip.close()


def dist_info_files(version: str, tag: str) -> Dict[str, str]:
    return {
        "METADATA": metadata_text(version),
        "WHEEL": ("Wheel-Version: 1.0\nGenerator: refit_build\nRoot-Is-Purelib: false\n"
                  f"Tag: {tag}\n"),
        "entry_points.txt": "[console_scripts]\nrefit = refit._cli:main\n",
    }


# ---------------------------------------------------------------------------------------------
# PEP 517 hooks


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    version = project_version()
    name = f"{NAME}-{version}.dist-info"
    os.makedirs(os.path.join(metadata_directory, name), exist_ok=True)
    for fname, text in dist_info_files(version, wheel_tag()).items():
        with open(os.path.join(metadata_directory, name, fname), "w", encoding="utf-8") as f:
            f.write(text)
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = project_version()
    tag = wheel_tag()
    package, cli = cmake_build(config_settings)
    os.makedirs(wheel_directory, exist_ok=True)
    wheel_name = f"{NAME}-{version}-{tag}.whl"
    w = WheelWriter(os.path.join(wheel_directory, wheel_name))
    for fname in sorted(os.listdir(package)):
        path = os.path.join(package, fname)
        if os.path.isfile(path) and not fname.endswith((".pyc", ".pth")):
            w.add_file(f"refit/{fname}", path)
    w.add_file("refit/bin/refit", cli)
    dist_info = f"{NAME}-{version}.dist-info"
    for fname, text in dist_info_files(version, tag).items():
        w.add(f"{dist_info}/{fname}", text.encode("utf-8"))
    w.close(f"{dist_info}/RECORD")
    return wheel_name


def _sdist_files() -> List[str]:
    """The tracked files (git), or every file outside build trees and caches."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                             capture_output=True).stdout
        return sorted(p for p in out.decode().split("\0") if p)
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(ROOT):
            rel = os.path.relpath(d, ROOT)
            dirs[:] = [x for x in dirs if not (x.startswith(("build", ".")) or x == "__pycache__")]
            files += [os.path.normpath(os.path.join(rel, n)) for n in names]
        return sorted(files)


def build_sdist(sdist_directory, config_settings=None):
    version = project_version()
    base = f"{NAME}-{version}"
    os.makedirs(sdist_directory, exist_ok=True)
    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel in _sdist_files():
            tar.add(os.path.join(ROOT, rel), arcname=f"{base}/{rel}", recursive=False)
        pkg_info = metadata_text(version).encode("utf-8")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return base + ".tar.gz"
