"""How every benchmark hands over its markdown: printed, and appended to ``--out`` if given."""
from __future__ import annotations


def publish(report: str, out: str | None) -> None:
    print(report)
    if out:
        with open(out, "a", encoding="utf-8") as fh:
            fh.write(report)
