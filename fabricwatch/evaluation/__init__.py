"""`fabricwatch eval`: labelled scenario suites, scored against the simulator's ground truth.

* `scenarios`: the suites as data (topology size, sampling interval, duration, faults, seed);
* `matching`: events vs `GroundTruth`: TP / FP / FN / delay per fault class;
* `baselines`: static Prometheus-style rules and river's HalfSpaceTrees on the same telemetry;
* `report`: runs everything through `streams.replay.replay` and writes ``docs/evaluation.md``
  with PNG plots under ``docs/evaluation/``.
"""
