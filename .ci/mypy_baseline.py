"""Rewrite pyproject.toml's mypy baseline: the error codes each module has today, switched off.

    python .ci/mypy_baseline.py

Runs mypy with the ``[tool.mypy]`` settings but without the baseline, then writes one
``[[tool.mypy.overrides]]`` block per module with errors, each code with its count, in place of
the old baseline (the end of pyproject.toml, after BEGIN). For after fixing errors (codes go
away) or merging code mypy has not seen; check the diff: a code new to a module may be a bug.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
BEGIN = "# -- mypy baseline, written by .ci/mypy_baseline.py"
ERROR = re.compile(r"^(\S+\.py):\d+: error: .*\[([a-z-]+)\]$")


def module_of(path: str) -> str:
    parts = path[:-3].split("/")
    if parts[0] in ("tests", "bench"):    # not packages: mypy names them by file
        parts = parts[-1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def baseline(mypy_output: str) -> str:
    errors: dict[str, Counter] = defaultdict(Counter)
    for line in mypy_output.splitlines():
        if m := ERROR.match(line):
            errors[module_of(m[1])][m[2]] += 1
    lines = [BEGIN + " (today's errors by module and code, with counts:",
             "# a new kind of error in a module fails tests/test_lint.py; fix one, then rerun it)"]
    for module, codes in sorted(errors.items()):
        ranked = sorted(codes.items(), key=lambda kv: (-kv[1], kv[0]))
        names = ", ".join(f'"{code}"' for code, _ in ranked)
        counts = ", ".join(f"{code} {n}" for code, n in ranked)
        lines += ["[[tool.mypy.overrides]]", f'module = "{module}"', f"disable_error_code = [{names}]  # {counts}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    text = PYPROJECT.read_text(encoding="utf-8")
    head = text.split(BEGIN, 1)[0].rstrip("\n") + "\n\n"
    with tempfile.NamedTemporaryFile("w", suffix=".toml", dir=ROOT) as cfg:
        cfg.write(head)
        cfg.flush()
        out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", cfg.name],
                             capture_output=True, text=True, cwd=ROOT)
    if out.returncode not in (0, 1):
        sys.exit(out.stdout[-2000:] + out.stderr[-2000:])
    new = baseline(out.stdout)
    PYPROJECT.write_text(head + new, encoding="utf-8")
    total = sum(1 for line in out.stdout.splitlines() if ERROR.match(line))
    print(f"{total} errors in {new.count('[[tool.mypy.overrides]]')} modules written to {PYPROJECT.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
