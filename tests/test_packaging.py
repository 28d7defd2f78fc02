"""The wheel holds every source module once, under ``fabricwatch.``.

The top-level package folders reach ``fabricwatch.*`` through the symlinks fabricwatch/<folder>
-> ../<folder> and pyproject's ``[tool.setuptools.packages.find]``; a folder without its
symlink would silently drop out of the wheel.
Each test builds the wheel from a copy of the tree without generated files, so the
``*_pb2`` modules in it come from setup.py's build step.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def package_folders(root: Path) -> list[str]:
    """Top-level folders that are packages (fabricwatch/ itself included)."""
    return sorted(p.parent.name for p in root.glob("*/__init__.py"))


def expected_files(root: Path) -> set[str]:
    """Paths the wheel must hold: every .py of every package folder, the generated gRPC and
    protobuf modules of every .proto, and the package data named in pyproject."""
    expected = set()
    for folder in package_folders(root):
        prefix = "fabricwatch" if folder == "fabricwatch" else f"fabricwatch/{folder}"
        for dirpath, dirnames, filenames in os.walk(root / folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not (Path(dirpath) / d).is_symlink()]
            rel = Path(dirpath).relative_to(root / folder).as_posix()
            where = prefix if rel == "." else f"{prefix}/{rel}"
            for name in filenames:
                if name.endswith(GENERATED_SUFFIXES):
                    continue
                if name.endswith((".py", ".proto")) or Path(rel).name == "static":
                    expected.add(f"{where}/{name}")
                if name.endswith(".proto"):
                    expected.update(f"{where}/{name[:-6]}{suffix}" for suffix in GENERATED_SUFFIXES)
    return expected


def copy_tree(dest: Path) -> Path:
    """What a build needs, without generated modules or build leftovers (symlinks kept)."""
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", *(f"*{s}" for s in GENERATED_SUFFIXES))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for folder in package_folders(ROOT):
        shutil.copytree(ROOT / folder, dest / folder, symlinks=True, ignore=ignore)
    return dest


def wheel_names(tree: Path, out: Path) -> list[str]:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extras: pip install -e '.[test]'")
    # No build isolation: the build requirements are installed here (and no index is needed).
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-cache-dir", "-q", "-w", str(out), str(tree)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (wheel,) = out.glob("fabricwatch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return [n for n in zf.namelist() if ".dist-info/" not in n]


def test_wheel_holds_every_source_module_once(tmp_path):
    tree = copy_tree(tmp_path / "src")
    names = wheel_names(tree, tmp_path / "wheel")
    assert [n for n, k in Counter(names).items() if k > 1] == []
    expected = expected_files(tree)
    # the sub-packages the issue named, so the expectation itself cannot shrink unnoticed
    for sub in ("fabricwatch/rank/", "fabricwatch/evaluation/", "fabricwatch/actions/alerts/",
                "fabricwatch/actions/executors/", "fabricwatch/protos/v1/", "fabricwatch/simulator/"):
        assert any(n.startswith(sub) for n in expected), sub
    assert "fabricwatch/protos/v1/records_pb2.py" in expected
    assert sorted(expected - set(names)) == []
    assert sorted(n for n in set(names) - expected if n.endswith(".py")) == []


def test_a_folder_without_its_symlink_drops_out_and_is_caught(tmp_path):
    # The check above must fail when a package would be left out: here models/ loses its link.
    tree = copy_tree(tmp_path / "src")
    (tree / "fabricwatch" / "models").unlink()
    names = set(wheel_names(tree, tmp_path / "wheel"))
    missing = expected_files(tree) - names
    assert "fabricwatch/models/baseline.py" in missing
    assert all(n.startswith("fabricwatch/models/") for n in missing)
