"""The GPUs of the simulated nodes, as NVML reads them.

Per tick each GPU's utilisation, SM clock, power, temperature and PCIe link follow what its
job did (compute, all-reduce, eval, checkpoint, idle: idle GPUs sit at the idle clock and
PCIe gen1, NVML's power saving); some hit their power cap; faults throttle them (thermal,
power: the clocks-event reasons of `host_faults`), narrow their PCIe link or lose them
(XID 79: every gauge unreadable). Counters: corrected ECC errors and PCIe replays at each
GPU's own small rate, uncorrectable ECC from faults, energy.

>>> round(_pcie_gbps(5, 16)), round(_pcie_gbps(5, 8))     # usable Gb/s of a gen5 x16, x8 link
(413, 207)
"""
from __future__ import annotations

import math

import numpy as np

from fabricwatch.counters import GPU_GAUGES
from fabricwatch.simulator.columns import _GC, GPU_COUNTERS, _Counters
from fabricwatch.simulator.fault_state import _FaultState
from fabricwatch.simulator.host_faults import REASON_GPU_IDLE, REASON_SW_POWER_CAP

# The GPU's constants: an H100 SXM's TDP and SM clocks, PCIe GT/s per generation.
GPU_TDP_W = 700.0
GPU_IDLE_W = 70.0
GPU_MAX_CLOCK_MHZ = 1980.0
GPU_IDLE_CLOCK_MHZ = 345.0
PCIE_GEN_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def _pcie_gbps(gen: int, width: int) -> float:
    """Usable PCIe bandwidth in Gb/s (128b/130b coding and ~82 % TLP efficiency)."""
    return PCIE_GEN_GTS.get(int(gen), 32.0) * width * (128 / 130) * 0.82


class GpuModel:
    """`ClusterSimulator`'s GPUs: their counters at the start, their gauges and counters each tick."""

    def _init_gpu_state(self, uptime: np.ndarray) -> None:
        """Every GPU's counters after its node's ``uptime`` (seconds), its noise rates, its temperature."""
        rng = self._rng
        N, G = len(self._nodes), self.G
        NG = N * G
        self._gpu = _Counters(GPU_COUNTERS, NG)
        g_up = np.repeat(uptime, G)
        self._gpu_ecc_rate = np.where(rng.random(NG) < 0.03, rng.uniform(1e-3, 0.05, NG), 0.0)
        self._gpu_replay_rate = np.where(rng.random(NG) < 0.02, rng.uniform(1e-4, 2e-3, NG), 0.0)
        gv = np.zeros((NG, len(GPU_COUNTERS)))
        gv[:, _GC["ecc_corrected_volatile_total"]] = np.floor(self._gpu_ecc_rate * g_up * 0.1)
        gv[:, _GC["pcie_replay_total"]] = np.floor(self._gpu_replay_rate * g_up)
        gv[:, _GC["energy_mj"]] = g_up * rng.uniform(250, 500, NG) * 1000
        self._gpu.values[:] = gv.astype(np.uint64)
        self._gpu_remap_corr = np.where(rng.random(NG) < 0.02, rng.integers(1, 4, NG), 0).astype(float)
        self._gpu_remap_unc = np.zeros(NG)
        self._gpu_hot = rng.uniform(0.95, 1.1, NG)       # per-GPU power appetite
        self._node_inlet = rng.uniform(22, 30, N)
        busy_w = np.where(self._node_job >= 0, 560.0, GPU_IDLE_W)
        self._gpu_temp = np.repeat(self._node_inlet + 0.065 * busy_w, G) + rng.normal(0, 1.5, NG)
        self._gpu_gauges = np.full((NG, len(GPU_GAUGES)), np.nan)
        self._gpu_prev_lost = np.zeros(NG, bool)

    def _simulate_gpus(self, fs: _FaultState, acc: np.ndarray, t0: float, t1: float) -> None:
        rng = self._rng
        dt = t1 - t0
        N, G = len(self._nodes), self.G
        NG = N * G
        nj = np.where(self._node_job < 0, len(self._jobs), self._node_job)
        fr = acc[nj, :5] / dt                                    # ckpt, compute, comm, eval, restart
        fr = np.repeat(fr, G, axis=0)
        busy_frac = fr.sum(axis=1)
        idle = np.clip(1 - busy_frac, 0, 1)
        util = (fr[:, 1] * rng.uniform(0.94, 1.0, NG) + fr[:, 2] * rng.uniform(0.88, 1.0, NG)
                + fr[:, 3] * rng.uniform(0.55, 0.85, NG) + fr[:, 0] * rng.uniform(0.0, 0.12, NG)
                + idle * rng.uniform(0.0, 0.02, NG)) * 100.0
        load = (0.92 * fr[:, 1] + 0.42 * fr[:, 2] + 0.6 * fr[:, 3] + 0.1 * fr[:, 0])
        power = GPU_IDLE_W * rng.uniform(0.95, 1.05, NG) + (GPU_TDP_W - GPU_IDLE_W) * load * self._gpu_hot * rng.uniform(0.93, 1.03, NG)
        power = power / np.where(fs.gpu_clock_factor < 1, 1 / fs.gpu_clock_factor, 1.0) ** 0.5
        capped = power > fs.gpu_power_cap
        power = np.minimum(power, fs.gpu_power_cap * rng.uniform(0.985, 1.0, NG))
        is_idle = util < 5.0
        clock = np.where(is_idle, GPU_IDLE_CLOCK_MHZ,
                         GPU_MAX_CLOCK_MHZ * np.where(capped, rng.uniform(0.86, 0.95, NG), rng.uniform(0.985, 1.0, NG)))
        slowed = fs.gpu_clock_factor < 1
        clock = np.where(slowed & ~is_idle, GPU_MAX_CLOCK_MHZ * fs.gpu_clock_factor * rng.uniform(0.98, 1.0, NG), clock)
        reason = np.where(is_idle, REASON_GPU_IDLE, fs.gpu_reason)   # throttling shows under load
        reason |= np.where(capped, REASON_SW_POWER_CAP, 0)
        target = np.repeat(self._node_inlet, G) + 0.065 * power + fs.gpu_temp_boost
        self._gpu_temp += (target - self._gpu_temp) * (1 - math.exp(-dt / 30.0))
        temp = np.round(self._gpu_temp)
        gen = np.where(is_idle, 1.0, 5.0)
        gg = self._gpu_gauges
        gg[:, 0] = np.round(util)
        gg[:, 1] = np.round(clock)
        gg[:, 2] = GPU_MAX_CLOCK_MHZ
        gg[:, 3] = reason
        gg[:, 4] = np.round(power * 1000.0)
        gg[:, 5] = temp
        gg[:, 6] = gen
        gg[:, 7] = 5.0
        gg[:, 8] = fs.gpu_pcie_width
        gg[:, 9] = 16.0
        gg[:, 10] = self._gpu_remap_corr
        self._gpu_remap_unc += fs.gpu_remap_unc
        gg[:, 11] = self._gpu_remap_unc
        lost = fs.gpu_lost
        gg[lost] = np.nan
        inc = np.zeros((NG, len(GPU_COUNTERS)))
        inc[:, 0] = rng.poisson(self._gpu_ecc_rate * dt)
        inc[:, 1] = fs.gpu_ecc_unc
        inc[:, 2] = rng.poisson(self._gpu_replay_rate * dt)
        inc[:, 3] = power * dt * 1000.0
        alive = ~lost & ~np.repeat(fs.node_down, G)
        self._gpu.add(inc, rows=np.nonzero(alive)[0])
