"""`fabricwatch eval`: labelled scenario suites, scored against the simulator's ground truth.

* `scenarios`: a scenario as data (topology size, sampling interval, duration, faults, seed);
* `fault_scenarios`, `negative_scenarios`: the builders of the labelled and the must-not-fire /
  healthy scenarios; `suites`: which scenarios one evaluation runs (`build_suites`);
* `matching`: events vs `GroundTruth`: TP / FP / FN / delay per fault class;
* `baselines`: static Prometheus-style rules and river's HalfSpaceTrees on the same telemetry;
* `runs`: each scenario simulated and run through `streams.replay.replay` and both baselines;
* `scoring`: the runs scored per detector and fault class, against the targets;
* `plots`: the PNG plots under ``docs/evaluation/``;
* `report`: writes ``docs/evaluation.md``; `evaluate` is the entry point.
"""
