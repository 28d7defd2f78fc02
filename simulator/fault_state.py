"""The faults of one tick, resolved: what the fabric, GPU and workload models read.

`fault_effects` fills one `_FaultState` per tick [t0, t1) from every active fault; the models
(`fabric`, `gpus`, `workload`) and the snapshots (`encoding`) read it. Arrays over NIC ports,
GPUs (flat ``node * G + gpu``), switch ports and jobs (one extra row: no job); the congestion
fields stay None in a run without congestion faults.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class _FaultState:
    """Faults resolved for one tick [t0, t1); arrays over ports / GPUs / switch ports / jobs."""
    cap_ratio: np.ndarray          # port traffic cap vs nominal, tick average
    speed_now: np.ndarray          # port speed (Gb/s) at sample time
    up_frac: np.ndarray            # fraction of the tick the NIC link was up
    down_now: np.ndarray           # link down at sample time
    down_events: np.ndarray        # UP->DOWN transitions in the tick
    down_phys: dict                # port -> phys_state label while down
    rate_now: dict                 # port -> rate label override
    nic_pcie_width: np.ndarray
    tx_duty: np.ndarray            # storm: pause duty a source NIC transmits
    xon_frames: np.ndarray
    rx_duty: np.ndarray            # storm victims: pause duty a NIC receives
    sw_duty: np.ndarray            # storm: duty at which a switch port is paused by its peer
    sw_occ: np.ndarray             # storm: queue3 occupancy forced on a switch port (bytes)
    wd_warn: np.ndarray
    wd_err: np.ndarray
    oos_burst: np.ndarray
    sp_admin_down_now: np.ndarray
    sp_up_frac: np.ndarray         # switch-to-switch ports: fraction up
    sp_transitions: np.ndarray
    gpu_reason: np.ndarray
    gpu_clock_factor: np.ndarray
    gpu_temp_boost: np.ndarray
    gpu_power_cap: np.ndarray
    gpu_pcie_width: np.ndarray
    gpu_lost: np.ndarray
    gpu_ecc_unc: np.ndarray
    gpu_remap_unc: np.ndarray
    rank_factor: np.ndarray        # busy multiplier per GPU (flat node*G+g)
    node_down: np.ndarray          # no snapshot this tick
    node_skew_s: np.ndarray
    events: dict                   # node -> list of DeviceEvent kwargs
    job_stall: np.ndarray          # the job's progress is blocked (hang)
    job_restart_left: dict         # job -> seconds of restart to (re)arm
    job_fault_speed: np.ndarray    # comm speed limit from faults (per job)
    failover: dict = field(default_factory=dict)   # dead NIC port -> share of its rail's speed left (via a sibling)
    # link down (LinkDown, SwitchLinkDown, NicAdminDown)
    carrier: dict = field(default_factory=dict)   # port down -> the sibling NIC that carries its traffic
    sp_down_now: np.ndarray | None = None          # switch port oper down (not admin) at sample time
    nic_admin_down: np.ndarray | None = None       # NIC shut on its host: netdev speed unreadable
    fec_unc_rate: np.ndarray | None = None         # extra post-FEC symbol errors per second (failing link)
    polarized: dict = field(default_factory=dict)  # leaf row -> spine columns its hash uses (EcmpPolarization)
    # congestion tuning (EcnAfterPause, Incast, QueueDrops), per switch / switch port; None: no such fault
    sw_ecn_factor: np.ndarray | None = None        # ECN marks a switch makes vs a healthy one
    sw_pause_gain: np.ndarray | None = None        # its pauses vs a healthy one's (no DCQCN slowdown)
    sw_level_floor: np.ndarray | None = None       # forced incast level
    sw_quiet: np.ndarray | None = None             # no incast at all
    q_drops: np.ndarray | None = None              # [switch port, (queue 3, queue 0)] drops per second
    nic_q_drops: np.ndarray | None = None          # NIC port: priority-3 receive discards per second
