"""Log lines written during a broker outage, per process (issue #13, docs/security.md).

Runs the scenario of tests/test_log_limits.py: a broker of its own, stopped for
`--outage` seconds while a gateway, a dashboard and an event feed run (each a process of
the given `--python`, i.e. of whichever checkout that interpreter has installed) and a
collector's sender (this checkout) streams to the gateway:

    python3 bench/outage_logs.py --python /path/to/other/venv/bin/python --outage 15
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_log_limits import outage_log_lines  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="interpreter whose fabricwatch runs the services")
    ap.add_argument("--outage", type=float, default=15.0, help="seconds the broker stays down")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        during = asyncio.run(outage_log_lines(args.python, Path(tmp), args.outage))
    print(f"log lines during a {args.outage:.0f} s broker outage ({args.python}): {during}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
