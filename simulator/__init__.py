"""fabricwatch.simulator: a simulated GPU training cluster that emits telemetry as the real
collectors do, with injected faults and their ground truth. It is the world model behind
`fabricwatch simulate` and `fabricwatch up --simulate` (driven by
`collectors/run_simulated.py`), `fabricwatch eval` (`fabricwatch/evaluation/scenarios.py`),
bench/ and the tests. Seeded: the same arguments give the same snapshots, bit for bit.

Where things are:

* `cluster` -- `ClusterSimulator` (start here): the topology index, the state at the start,
  the tick; `Fault`, the union of every fault it injects. Its parts, one module each:
  * `fault_effects` -- every fault checked, then resolved per tick into a `fault_state._FaultState`
  * `workload` -- `Job`, `auto_jobs`; steps, `RankStep`, heartbeats, rank-side faults (hangs)
  * `fabric` -- flows and ECMP routes, NIC and switch-port traffic, PFC pauses, ECN marks and CNPs, queues
  * `gpus` -- NVML gauges and counters: utilisation, clocks, power, throttling, PCIe, ECC
  * `encoding` -- the protobuf snapshots, and `Cadence` / `COLLECTOR_CADENCE` (when what is read)
  * `labelling` -- the `GroundTruth` of each fault
* `columns` -- each block's counters in column order; the matrices of raw totals (wrap, saturate)
* the fault catalogue, frozen dataclasses: `fabric_faults` (links, switch ports, PFC storms and
  deadlocks, ECMP, ECN/queues) and `host_faults` (GPUs, nodes, stragglers, hangs, job stalls)
* `labels` -- `GroundTruth` and the entity paths (what `fabricwatch.evaluation` scores against)
* `timeline` -- event time: seconds after the start (`INF`: never), `DEFAULT_START_UNIX_NS`
* `demo` -- `demo_scenario`, the README demo's three faults

Import each name from the module that defines it; this package re-exports nothing.
"""
