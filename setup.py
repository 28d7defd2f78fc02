"""Build hook: compile protos/v1/*.proto with grpcio-tools before packaging.

Generated modules (`*_pb2.py`, `*_pb2_grpc.py`, `*_pb2.pyi`) are written next to the
.proto files and git-ignored, so editable installs see them too. Never edit them by hand.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_DIR = ROOT / "protos" / "v1"
# Import path the generated code uses: fabricwatch/protos/v1/<name>.proto
IMPORT_PREFIX = Path("fabricwatch") / "protos" / "v1"


def compile_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        out = Path(tmp) / "out"
        (src / IMPORT_PREFIX).mkdir(parents=True)
        out.mkdir()
        protos = sorted(PROTO_DIR.glob("*.proto"))
        for proto in protos:
            shutil.copy(proto, src / IMPORT_PREFIX / proto.name)
        args = [
            "grpc_tools.protoc",
            f"-I{src}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *[str(IMPORT_PREFIX / p.name) for p in protos],
        ]
        cwd = Path.cwd()
        try:
            import os

            os.chdir(src)
            rc = protoc.main(args)
        finally:
            os.chdir(cwd)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        for generated in (out / IMPORT_PREFIX).iterdir():
            shutil.copy(generated, PROTO_DIR / generated.name)


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        compile_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
