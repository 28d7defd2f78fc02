"""Record with `fabricwatch simulate --record`, replay with `fabricwatch replay`: deterministic, robust."""
import json
import subprocess
import sys

import pytest


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "fabricwatch.cli", *args], capture_output=True, text=True,
                          timeout=300, **kw)


@pytest.mark.slow
def test_record_then_replay_twice_gives_identical_anomalies(tmp_path):
    rec, out1, out2 = tmp_path / "telemetry.jsonl", tmp_path / "a1.jsonl", tmp_path / "a2.jsonl"
    r = cli("simulate", "--nodes", "16", "--duration", "35", "--as-fast-as-possible", "--record", str(rec),
            "--topology-out", str(tmp_path / "topo.yaml"))
    assert r.returncode == 0, r.stderr
    for out in (out1, out2):
        r = cli("replay", "--input", str(rec), "--output", str(out), "--topology", str(tmp_path / "topo.yaml"))
        assert r.returncode == 0, r.stderr
    assert out1.read_bytes() == out2.read_bytes()
    events = [json.loads(line) for line in out1.read_text().splitlines()]
    opened = {(e["kind"], e["entity"].get("node", ""), e["entity"].get("device", "")) for e in events
              if e["lifecycle"] == "LIFECYCLE_OPEN"}
    kinds = {k for k, _, _ in opened}
    assert {"link_downgrade", "pfc_storm", "straggler"} <= kinds, opened
    storm = [e for e in events if e["kind"] == "pfc_storm" and e["lifecycle"] == "LIFECYCLE_OPEN"][0]
    assert storm["entity"]["device"].startswith("mlx5_") and storm["related"], storm   # a source with victims


@pytest.mark.slow
def test_malformed_lines_are_counted_and_valid_ones_kept(tmp_path):
    rec = tmp_path / "telemetry.jsonl"
    r = cli("simulate", "--nodes", "4", "--duration", "12", "--as-fast-as-possible", "--record", str(rec),
            "--scenario", "healthy")
    assert r.returncode == 0, r.stderr
    good = rec.read_text().splitlines()
    hostile = ["{not json", '{"source": 5}', '{"blocks": "x"}', "\x00\x01", '{"time_unix_ns": "NaN"}',
               json.dumps({"source": "node-x", "source_kind": "SOURCE_KIND_NODE", "time_unix_ns": "1",
                           "blocks": [{"entity_kind": "ENTITY_KIND_GPU", "entity_ids": ["gpu0"],
                                       "counter_names": ["a", "b"], "counters": ["1"]}]})]
    mixed = good[:10] + hostile + good[10:]
    rec.write_text("\n".join(mixed) + "\n")
    r = cli("replay", "--input", str(rec), "--output", str(tmp_path / "out.jsonl"))
    assert r.returncode == 0, r.stderr
    stats = dict(kv.split("=") for kv in r.stderr.strip().splitlines()[-1].split("; ")[1].split())
    assert int(stats["malformed_records"]) == 5
    assert int(stats["problem:bad_counter_count"]) == 1
    assert int(stats["snapshots"]) == len(good) + 1    # node-x kept, without its broken block
