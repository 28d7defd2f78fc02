"""The README's main command, end to end: `fabricwatch up --simulate` on the real broker.

The local stack (gateway with TLS and token, worker, simulator) runs as separate processes;
the demo scenario's three faults must all be flagged with their named source.
"""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.kafka


def test_up_flags_the_demo_faults(kafka_bootstrap, tmp_path, unused_tcp_port):
    proc = subprocess.run(
        [sys.executable, "-m", "fabricwatch.cli", "up", "--simulate", "--broker", kafka_bootstrap,
         "--nodes", "32", "--duration", "150", "--state-dir", str(tmp_path / "state"),
         "--gateway-listen", f"127.0.0.1:{unused_tcp_port}",
         "--expect", "link_downgrade,pfc_storm,straggler"],
        capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "all expected anomaly kinds flagged" in out
    storm = [line for line in out.splitlines() if "pfc_storm" in line and "OPEN" in line]
    assert storm and " from node-" in storm[0]          # the source is named, not a victim
    assert any("link_downgrade" in line and "200 Gb/sec" in line for line in out.splitlines())
