"""The simulated fabric: RoCEv2 traffic over NIC ports, leaves and spines, and its PFC, ECN and ECMP.

Each job's all-reduce is two ring channels per NIC position (`FabricModel._build_flows`);
a flow between two leaves crosses one spine (a static ECMP hash) or, with ``ecmp_spread``,
every spine the leaves share, with some jitter per tick. Per tick (`_simulate_fabric`) the
ports send what their jobs' phases ask for, capped by link speed, faults and pauses: incast
episodes at the leaves pause the NICs behind them in short XOFF/XON bursts, mark ECN (CNPs
back to the senders), and spread as pauses over the switch links; storms and deadlocks
(resolved by `fault_effects`) hold ports continuously. What a NIC transmits its leaf port
receives; pause frames a NIC sends its leaf port receives; bytes crossing a spine count on
both ends of each uplink; queues drop what is in flight at a link transition, and queue 0
a little always.
"""
from __future__ import annotations

import numpy as np

from fabricwatch.simulator.columns import (
    _NC, _SC, _SWITCH_ALL, NIC_COUNTERS, SWITCH_PORT_GAUGES, SWITCH_TX_PAUSE_DURATION, _Counters,
)
from fabricwatch.simulator.fault_state import _FaultState


# Physical constants of the model (documented guesses where no source gives a number).
WIRE_PKT_BYTES = 4158.0        # 4096 B RoCEv2 payload + Eth/IP/UDP/BTH/ICRC/FCS headers
ACK_BYTES = 62.0               # RoCE ACK on the wire
ACKS_PER_DATA_PKT = 1.0 / 8.0  # coalesced ACKs
PAUSE_QUANTA = 65535           # XOFF frames carry the max quanta; refreshed at half expiry
XMIT_WAIT_TICKS_PER_US = 8.0   # port_xmit_wait tick: implementation-defined [U]
CTRL_BYTES_PER_S = 300.0       # LLDP/ARP on the backend fabric (not RDMA, not prio 3)

# Counter quirk: NIC ports whose 32-bit port_xmit_wait has saturated over a long uptime and
# was never cleared (IBA PortCounters stop at all ones); drawn from a separate stream.
XMIT_WAIT_PINNED_FRACTION = 0.1

LINK_EVENT_DROPS = 5.0         # packets of each queue in flight lost at a link transition [U]
LOSSY_DROPS_PER_S = 0.5        # best-effort queue 0 drops a little all the time (lossy by design) [U]
UPLINK_MARK_PER_DUTY = 0.5     # CE-mark probability of a switch link's egress per unit of the pause duty it causes [U]

# Per (leaf, spine) and tick, the spread traffic's share varies by this lognormal sigma
# (ecmp_spread): flows start and stop, bursts land unevenly; a working hash over many QPs.
ECMP_JITTER_SIGMA = 0.25


class FabricModel:
    """`ClusterSimulator`'s fabric: flows and routes, NIC and switch-port counters at the start and each tick."""

    def _build_flows(self) -> None:
        """Each job's all-reduce as two ring channels per NIC position: node order and a shuffle."""
        rng = self._rng
        src, dst, w, fjob = [], [], [], []
        for jr in self._jobs:
            nodes = list(jr.node_idx)
            if len(nodes) < 2:
                continue
            k_max = min(len(self._node_ports[n]) for n in nodes)
            orders = [nodes, [nodes[i] for i in rng.permutation(len(nodes))]]
            for order in orders:
                for i, n in enumerate(order):
                    m = order[(i + 1) % len(order)]
                    for k in range(k_max):
                        src.append(self._node_ports[n][k])
                        dst.append(self._node_ports[m][k])
                        w.append(0.5)
                        fjob.append(jr.index)
        self._f_src = np.array(src, dtype=np.int64)
        self._f_dst = np.array(dst, dtype=np.int64)
        self._f_w = np.array(w, dtype=float)
        self._f_job = np.array(fjob, dtype=np.int64)
        F = len(src)
        self.F = F
        leaf_row = np.array([self._leaf_row.get(int(s), -1) for s in self._p_switch], dtype=np.int64)
        self._f_la = leaf_row[self._f_src] if F else np.zeros(0, np.int64)
        self._f_lb = leaf_row[self._f_dst] if F else np.zeros(0, np.int64)
        self._f_spine = np.full(F, -1, dtype=np.int64)
        self._f_spine_pref: dict[int, list[int]] = {}
        n_sp = self._lu.shape[1]
        for f in range(F):
            a, b = self._f_la[f], self._f_lb[f]
            if a < 0 or b < 0 or a == b:
                continue
            common = [c for c in range(n_sp) if self._lu[a, c] >= 0 and self._lu[b, c] >= 0]
            if not common:
                continue
            h = (int(self._f_src[f]) * 7919 + int(self._f_dst[f]) * 104729) % len(common)
            pref = common[h:] + common[:h]
            self._f_spine_pref[f] = pref
            self._f_spine[f] = pref[0]
        self._routes_base = self._f_spine
        self._set_routes(self._routes_base)
        self._p_has_flow = np.zeros(self.P, dtype=bool)
        self._p_has_flow[self._f_src] = True
        self._p_has_flow[self._f_dst] = True

    def _set_routes(self, spine: np.ndarray) -> None:
        self._rerouted = spine is not self._routes_base
        remote = spine >= 0
        s = np.where(remote, spine, 0)
        la = np.where(remote, self._f_la, 0)
        lb = np.where(remote, self._f_lb, 0)
        self._f_remote = remote
        self._f_up_src = np.where(remote, self._lu[la, s], -1)
        self._f_sp_a = np.where(remote, self._sd[la, s], -1)
        self._f_sp_b = np.where(remote, self._sd[lb, s], -1)
        self._f_up_dst = np.where(remote, self._lu[lb, s], -1)

    def _init_nic_state(self, uptime: np.ndarray) -> None:
        """Every NIC port's counters after its node's ``uptime`` (seconds), its BER, marginal links."""
        rng = self._rng
        P = self.P
        up_p = uptime[self._p_node]
        util = rng.uniform(0.1, 0.4, P)
        words = up_p * util * self._p_nominal_Bps / 4
        self._nic = _Counters(NIC_COUNTERS, P)
        v = np.zeros((P, len(NIC_COUNTERS)))
        c = _NC
        # links: per-port pre-FEC BER; ~2 % marginal links that also see symbol errors
        self._p_ber = np.exp(rng.normal(np.log(5e-8), 1.0, P))
        self._p_marginal = rng.random(P) < 0.02
        v[:, c["port_xmit_data"]] = words * rng.uniform(0.98, 1.02, P)
        v[:, c["port_rcv_data"]] = words
        v[:, c["port_xmit_packets"]] = v[:, c["port_xmit_data"]] * 4 / 3900
        v[:, c["port_rcv_packets"]] = words * 4 / 3900
        v[:, c["port_xmit_wait"]] = rng.uniform(0, 2 ** 32, P)
        pinned = np.random.default_rng([self.seed, 0x9A7]).random(P) < XMIT_WAIT_PINNED_FRACTION
        v[pinned, c["port_xmit_wait"]] = 2 ** 32 - 1
        v[:, c["symbol_error"]] = np.where(self._p_marginal, rng.integers(0, 3000, P), 0)
        v[:, c["symbol_error"]] = np.where(rng.random(P) < 0.003, 65535, v[:, c["symbol_error"]])
        v[:, c["port_rcv_errors"]] = np.where(self._p_marginal, rng.integers(0, 50, P), 0)
        v[:, c["link_downed"]] = rng.choice([0, 0, 0, 1, 1, 2], P)
        v[:, c["link_error_recovery"]] = np.where(rng.random(P) < 0.05, 1, 0)
        v[:, c["out_of_sequence"]] = rng.integers(0, 200_000, P)
        v[:, c["np_ecn_marked_roce_packets"]] = v[:, c["port_rcv_packets"]] * rng.uniform(1e-3, 5e-3, P)
        v[:, c["np_cnp_sent"]] = v[:, c["np_ecn_marked_roce_packets"]] * 0.35
        v[:, c["rp_cnp_handled"]] = v[:, c["np_cnp_sent"]] * rng.uniform(0.95, 1.05, P)
        v[:, c["rx_prio3_pause_duration"]] = up_p * 1e6 * rng.uniform(1e-3, 8e-3, P)
        v[:, c["rx_prio3_pause"]] = v[:, c["rx_prio3_pause_duration"]] / 12
        v[:, c["tx_prio3_pause_duration"]] = up_p * 1e6 * rng.uniform(0, 2e-4, P)
        v[:, c["tx_prio3_pause"]] = v[:, c["tx_prio3_pause_duration"]] / 12
        v[:, c["rx_prio3_bytes"]] = v[:, c["port_rcv_data"]] * 4
        v[:, c["tx_prio3_bytes"]] = v[:, c["port_xmit_data"]] * 4
        v[:, c["rx_prio3_packets"]] = v[:, c["port_rcv_packets"]]
        v[:, c["tx_prio3_packets"]] = v[:, c["port_xmit_packets"]]
        v[:, c["link_down_events_phy"]] = v[:, c["link_downed"]]
        v[:, c["rx_bits_phy"]] = up_p * self._p_nominal_gbps * 1e9
        v[:, c["rx_corrected_bits_phy"]] = v[:, c["rx_bits_phy"]] * self._p_ber
        v[:, c["rx_pcs_symbol_err_phy"]] = np.where(self._p_marginal, rng.integers(0, 500, P), 0)
        self._nic.values[:] = np.floor(v).astype(np.uint64)
        self._nic.clamp()

    def _init_switch_state(self) -> None:
        """Every switch port's counters after the switch's uptime; the congestion processes at rest."""
        rng = self._rng
        P, SP = self.P, self.SP
        self._sw = _Counters(_SWITCH_ALL, SP)
        sw_up = rng.uniform(30, 400, len(self._switches))[self._sp_switch] * 86400.0
        sv = np.zeros((SP, len(_SWITCH_ALL)))
        octets = sw_up * rng.uniform(0.1, 0.35, SP) * self._sp_nominal_gbps * 1e9 / 8
        sv[:, _SC["in-octets"]] = octets
        sv[:, _SC["out-octets"]] = octets * rng.uniform(0.97, 1.03, SP)
        sv[:, _SC["in-pkts"]] = octets / 3900
        sv[:, _SC["out-pkts"]] = sv[:, _SC["out-octets"]] / 3900
        sv[:, _SC["in-errors"]] = np.where(rng.random(SP) < 0.03, rng.integers(1, 400, SP), 0)
        sv[:, _SC["in-discards"]] = rng.integers(0, 20, SP)
        sv[:, _SC["out-discards"]] = rng.integers(0, 200, SP)
        sv[:, _SC["interface-transitions"]] = 2 * rng.integers(1, 6, SP)
        sv[:, _SC["pfc3-rx-pause-duration-us"]] = sw_up * 1e6 * rng.uniform(1e-5, 5e-4, SP)
        sv[:, _SC["pfc3-rx-pkts"]] = sv[:, _SC["pfc3-rx-pause-duration-us"]] / 12
        sv[:, _SC["pfc3-tx-pkts"]] = sw_up * 1e6 * rng.uniform(1e-3, 8e-3, SP) / 12
        sv[:, _SC[SWITCH_TX_PAUSE_DURATION]] = sv[:, _SC["pfc3-tx-pkts"]] * 12
        sv[:, _SC["queue3-transmit-octets"]] = sv[:, _SC["out-octets"]] * 0.999
        sv[:, _SC["queue3-transmit-pkts"]] = sv[:, _SC["out-pkts"]] * 0.999
        self._sw.values[:] = sv.astype(np.uint64)
        self._sw_marginal = rng.random(SP) < 0.02
        # FEC: its own random stream, so that adding it moved no other draw
        self._fec_rng = np.random.default_rng([self.seed, 0xFEC])
        self._sp_ber = np.exp(self._fec_rng.normal(np.log(5e-8), 1.0, SP))
        self._sw.values[:, _SC["in-fec-correctable-frames"]] = np.floor(
            sw_up * self._sp_nominal_gbps * 1e9 * self._sp_ber).astype(np.uint64)
        # queue ECN marks and drops: their own random stream too
        self._q_rng = np.random.default_rng([self.seed, 0xECE])
        self._sw.values[:, _SC["queue3-ecn-marked-pkts"]] = np.floor(
            self._sw.values[:, _SC["queue3-transmit-pkts"]] * self._q_rng.uniform(1e-3, 5e-3, SP)).astype(np.uint64)
        self._sw.values[:, _SC["queue0-dropped-pkts"]] = self._q_rng.integers(0, 5000, SP).astype(np.uint64)
        self._sw_gauges = np.zeros((SP, len(SWITCH_PORT_GAUGES)))
        # congestion processes
        S = len(self._switches)
        self._leaf_level = np.zeros(S)
        self._leaf_left = np.zeros(S)
        self._nic_slow_level = np.zeros(P)
        self._nic_slow_left = np.zeros(P)
        self._p_act = np.zeros(P)

    def _simulate_fabric(self, fs: _FaultState, acc: np.ndarray, t0: float, t1: float) -> None:
        rng = self._rng
        dt = t1 - t0
        P, SP = self.P, self.SP
        pj = self._node_job[self._p_node]                      # -1 = idle -> row nj (zeros)
        pj = np.where(pj < 0, len(self._jobs), pj)
        # line-rate seconds of traffic each port would send in the tick
        line_s = acc[pj, 5] + 0.02 * acc[pj, 1] + 0.05 * acc[pj, 3] + 0.002 * acc[pj, 0]
        act = np.clip(line_s / dt * self._job_eff[pj], 0.0, 1.0) * self._p_has_flow
        # --- healthy congestion: leaf incast episodes (bursty, correlated with comm bursts)
        S = len(self._switches)
        leaf_act = np.bincount(self._p_switch, weights=act, minlength=S) / np.maximum(
            np.bincount(self._p_switch, minlength=S), 1)
        # an episode's level is the pause duty during the comm bursts, the sampled duty is
        # that times the fraction of the interval spent bursting
        start = (self._leaf_left <= 0) & (rng.random(S) < 1 - np.exp(-0.15 * dt * np.minimum(1.0, 3 * leaf_act)))
        self._leaf_left = np.where(start, rng.exponential(3.0, S), self._leaf_left - dt)
        self._leaf_level = np.where(start, np.clip(rng.lognormal(np.log(0.25), 0.7, S), 0, 0.9),
                                    np.where(self._leaf_left > 0, self._leaf_level, 0.0))
        level = self._congestion_level(fs)
        lvl = level[self._p_switch]
        base = np.where(rng.random(P) < 0.35, rng.exponential(0.03, P), 0.0)
        h_rx = np.clip(act * (base + lvl * rng.uniform(0.3, 1.5, P)), 0.0, 0.6)
        if fs.sw_pause_gain is not None:     # a switch that pauses before marking pauses more (and a quiet one not)
            h_rx = np.clip(h_rx * fs.sw_pause_gain[self._p_switch], 0.0, 0.6) * ~fs.sw_quiet[self._p_switch]
        # slow receivers: a NIC occasionally pauses its leaf for a little while
        s_start = (self._nic_slow_left <= 0) & (rng.random(P) < 1 - np.exp(-0.005 * dt))
        self._nic_slow_left = np.where(s_start, rng.exponential(2.0, P), self._nic_slow_left - dt)
        self._nic_slow_level = np.where(s_start, rng.uniform(0.002, 0.03, P),
                                        np.where(self._nic_slow_left > 0, self._nic_slow_level, 0.0))
        h_tx = act * self._nic_slow_level
        rx_duty = np.maximum(h_rx, fs.rx_duty) * fs.up_frac
        tx_duty = np.maximum(h_tx * fs.up_frac, fs.tx_duty)
        # --- traffic
        eff = self._job_eff[pj]
        want = line_s * self._p_nominal_Bps * eff * rng.uniform(0.97, 1.0, P)
        cap = fs.cap_ratio * self._p_nominal_Bps * dt * fs.up_frac * (1 - rx_duty) * 0.97
        carrier = np.arange(P)
        if fs.carrier:     # NCCL failover: the dead NIC's flows leave through its sibling
            carrier[list(fs.carrier)] = list(fs.carrier.values())
            cap = cap[carrier]
        base_tx = np.minimum(want, cap)
        # switch-link pause duty (healthy: spines and leaves pausing each other a little)
        sw_h = np.zeros(SP)
        link = self._is_link_sp
        if np.any(link):
            peer_lvl = level[self._sp_switch[np.where(link, self._sp_peer_sp, 0)]]
            nl = int(link.sum())
            sw_h[link] = np.clip(0.25 * peer_lvl[link] * rng.uniform(0.2, 1.2, nl)
                                 + np.where(rng.random(nl) < 0.2, rng.exponential(0.004, nl), 0.0), 0.0, 0.4)
            # only links that carry traffic get paused: scale by the leaf end's activity
            sw_h[link] *= np.minimum(1.0, 2 * (leaf_act[self._sp_switch[link]]
                                               + leaf_act[self._sp_switch[self._sp_peer_sp[link]]]))
        sw_duty = np.maximum(sw_h, fs.sw_duty) * fs.sp_up_frac
        # routes: reroute around switch links that are down
        if np.any(fs.sp_up_frac[link] < 1.0):
            spine = self._routes_base.copy()
            for f, pref in self._f_spine_pref.items():
                for c in pref:
                    a, b = self._lu[self._f_la[f], c], self._lu[self._f_lb[f], c]
                    if fs.sp_up_frac[a] >= 1.0 and fs.sp_up_frac[b] >= 1.0:
                        spine[f] = c
                        break
            self._set_routes(spine)
        elif self._rerouted:
            self._set_routes(self._routes_base)
        F = self.F
        tx = np.zeros(P)
        rx = np.zeros(P)
        sw_in = np.zeros(SP)
        sw_out = np.zeros(SP)
        sw_in_p = np.zeros(SP)
        sw_out_p = np.zeros(SP)
        cnp_handled = np.zeros(P)
        if F:
            src, dst = carrier[self._f_src], carrier[self._f_dst]
            pass_ = fs.up_frac[dst] * (1 - tx_duty[dst]) * rng.uniform(0.98, 1.0, F)
            rem = self._f_remote
            if np.any(rem):
                pass_[rem] *= (1 - sw_duty[self._f_up_src[rem]]) * (1 - sw_duty[self._f_sp_b[rem]])
            fb = base_tx[src] * self._f_w * np.clip(pass_, 0, 1)
            fpk = fb / WIRE_PKT_BYTES
            apk = fpk * ACKS_PER_DATA_PKT
            ab = apk * ACK_BYTES
            tx = np.bincount(src, fb, P) + np.bincount(dst, ab, P)
            rx = np.bincount(dst, fb, P) + np.bincount(src, ab, P)
            tx_pk = np.bincount(src, fpk, P) + np.bincount(dst, apk, P)
            rx_pk = np.bincount(dst, fpk, P) + np.bincount(src, apk, P)
            if np.any(rem) and self.ecmp_spread:
                self._spread_uplink_traffic(fs, rem, fb, fpk, ab, apk, sw_in, sw_out, sw_in_p, sw_out_p)
            elif np.any(rem):
                us, sa, sb, ud = (self._f_up_src[rem], self._f_sp_a[rem], self._f_sp_b[rem], self._f_up_dst[rem])
                b_, pk_ = fb[rem], fpk[rem]
                ab_, apk_ = ab[rem], apk[rem]
                # data: src leaf uplink out -> spine port(a) in -> spine port(b) out -> dst leaf uplink in
                sw_out += np.bincount(us, b_, SP) + np.bincount(ud, ab_, SP)
                sw_in += np.bincount(sa, b_, SP) + np.bincount(sb, ab_, SP)
                sw_out += np.bincount(sb, b_, SP) + np.bincount(sa, ab_, SP)
                sw_in += np.bincount(ud, b_, SP) + np.bincount(us, ab_, SP)
                sw_out_p += np.bincount(us, pk_, SP) + np.bincount(ud, apk_, SP) + np.bincount(sb, pk_, SP) + np.bincount(sa, apk_, SP)
                sw_in_p += np.bincount(sa, pk_, SP) + np.bincount(sb, apk_, SP) + np.bincount(ud, pk_, SP) + np.bincount(us, apk_, SP)
        else:
            tx_pk = np.zeros(P)
            rx_pk = np.zeros(P)
        rx_frac = np.clip(rx / np.maximum(self._p_nominal_Bps * dt, 1.0), 0, 1)
        # --- ECN marks at the receiver, CNPs back to the senders
        mark_p = np.clip(0.0015 + 0.12 * lvl * rng.uniform(0.3, 1.5, P), 0, 0.3) * (rx_frac > 1e-4)
        if fs.sw_ecn_factor is not None:     # CE marks come from the receiver's leaf
            mark_p = mark_p * fs.sw_ecn_factor[self._p_switch]
        marked = (rx_pk - np.bincount(src, apk, P) if F else rx_pk) * mark_p   # data packets only
        cnp_sent = marked * rng.uniform(0.25, 0.45, P)
        if F:
            share = fpk / np.maximum(np.bincount(dst, fpk, P)[dst], 1e-9)
            cnp_handled = np.bincount(src, cnp_sent[dst] * share, P)
        # --- pause frames: healthy pauses are short XOFF/XON episodes, storms continuous XOFF
        refresh_us = PAUSE_QUANTA * 512 / (np.maximum(fs.speed_now, 1.0) * 1e3) / 2
        ep_us = rng.uniform(8, 40, P)
        rx_us = rx_duty * dt * 1e6
        tx_us = tx_duty * dt * 1e6
        rx_frames = np.where(fs.rx_duty > h_rx, rx_us / refresh_us, 2 * rx_us / ep_us)
        tx_frames = np.where(fs.tx_duty > h_tx, tx_us / refresh_us, 2 * tx_us / ep_us) + fs.xon_frames
        # --- link quality
        bits = fs.speed_now * 1e9 * dt * fs.up_frac
        corrected = bits * self._p_ber * rng.uniform(0.8, 1.2, P)
        m = self._p_marginal
        inc = np.zeros((P, len(NIC_COUNTERS)))
        c = _NC
        inc[:, c["port_xmit_data"]] = tx / 4
        inc[:, c["port_rcv_data"]] = rx / 4
        inc[:, c["port_xmit_packets"]] = tx_pk
        inc[:, c["port_rcv_packets"]] = rx_pk
        inc[:, c["port_xmit_wait"]] = rx_us * XMIT_WAIT_TICKS_PER_US * (act > 0)
        inc[:, c["symbol_error"]] = rng.poisson(np.where(m, 0.02, 0.0) * dt, P) + fs.down_events * rng.integers(0, 3, P)
        inc[:, c["port_rcv_errors"]] = rng.poisson(np.where(m, 0.002, 0.0) * dt, P)
        inc[:, c["link_downed"]] = fs.down_events
        inc[:, c["link_error_recovery"]] = 0
        inc[:, c["out_of_sequence"]] = rng.poisson(rx_pk * 2e-10 + fs.oos_burst * 40, P)
        inc[:, c["np_cnp_sent"]] = cnp_sent
        inc[:, c["np_ecn_marked_roce_packets"]] = marked
        inc[:, c["rp_cnp_handled"]] = cnp_handled
        inc[:, c["rx_prio3_pause"]] = rx_frames
        inc[:, c["tx_prio3_pause"]] = tx_frames
        inc[:, c["rx_prio3_pause_duration"]] = rx_us
        inc[:, c["tx_prio3_pause_duration"]] = tx_us
        inc[:, c["rx_prio3_bytes"]] = rx
        inc[:, c["tx_prio3_bytes"]] = tx
        inc[:, c["rx_prio3_packets"]] = rx_pk
        inc[:, c["tx_prio3_packets"]] = tx_pk
        inc[:, c["tx_pause_storm_warning_events"]] = fs.wd_warn
        inc[:, c["tx_pause_storm_error_events"]] = fs.wd_err
        inc[:, c["link_down_events_phy"]] = fs.down_events
        inc[:, c["rx_corrected_bits_phy"]] = corrected
        inc[:, c["rx_bits_phy"]] = bits
        inc[:, c["rx_pcs_symbol_err_phy"]] = rng.poisson(np.where(m, 0.05, 0.0) * dt + fs.fec_unc_rate * dt, P)
        self._nic_queue_drops(fs, inc, dt)
        live = ~fs.node_down[self._p_node] | (fs.up_frac > 0)
        self._nic.add(inc, rows=np.nonzero(live)[0])
        self._p_act = act
        # --- NIC gauges at sample time
        g = self._nic_gauges
        g[:, 0] = np.where(fs.down_now, np.where(fs.nic_admin_down, np.nan, -1.0), fs.speed_now * 1000.0)
        g[:, 1] = fs.nic_pcie_width
        g[:, 2] = 16.0
        g[:, 3] = 5.0
        g[:, 4] = 5.0
        self._fs_labels = (fs.rate_now, fs.down_now, fs.down_phys)
        # --- switch ports
        sinc = np.zeros((SP, len(_SWITCH_ALL)))
        sc = _SC
        dl = self._sp_peer_nic >= 0
        q = self._sp_peer_nic[dl]
        ctrl = CTRL_BYTES_PER_S * dt
        up_dl = fs.up_frac[q]
        sw_in[dl] = tx[q] + ctrl * up_dl
        sw_out[dl] = rx[q] + ctrl * up_dl
        sw_in_p[dl] = tx_pk[q] + ctrl / 100 * up_dl
        sw_out_p[dl] = rx_pk[q] + ctrl / 100 * up_dl
        rdma_out = sw_out.copy()
        rdma_out_p = sw_out_p.copy()
        rdma_out[dl] = rx[q]
        rdma_out_p[dl] = rx_pk[q]
        sp_rx_us = np.zeros(SP)
        sp_rx_frames = np.zeros(SP)
        sp_tx_frames = np.zeros(SP)
        sp_tx_us = np.zeros(SP)                 # pauses a switch port sends = its peer receives
        sp_tx_us[dl] = rx_us[q]
        sp_rx_us[dl] = tx_us[q]
        sp_rx_frames[dl] = tx_frames[q]
        sp_tx_frames[dl] = rx_frames[q]
        if np.any(link):
            li = np.nonzero(link)[0]
            us_ = sw_duty[li] * dt * 1e6
            sp_speed = self._sp_nominal_gbps[li]
            fr = np.where(fs.sw_duty[li] > sw_h[li], us_ / (PAUSE_QUANTA * 512 / (sp_speed * 1e3) / 2),
                          2 * us_ / rng.uniform(8, 40, li.size))
            sp_rx_us[li] = us_
            sp_rx_frames[li] = fr
            sp_tx_frames[self._sp_peer_sp[li]] = fr
            sp_tx_us[self._sp_peer_sp[li]] = us_
        sinc[:, sc["in-octets"]] = sw_in
        sinc[:, sc["out-octets"]] = sw_out
        sinc[:, sc["in-pkts"]] = sw_in_p
        sinc[:, sc["out-pkts"]] = sw_out_p
        sm = self._sw_marginal
        sinc[:, sc["in-errors"]] = rng.poisson(np.where(sm, 0.01, 0.0) * dt, SP)
        sinc[:, sc["in-discards"]] = rng.poisson(1e-4 * dt, SP)
        sinc[:, sc["out-discards"]] = rng.poisson(2e-4 * dt + fs.sp_transitions * 5, SP)
        sinc[:, sc["interface-transitions"]] = fs.sp_transitions
        sinc[:, sc["pfc3-rx-pkts"]] = sp_rx_frames
        sinc[:, sc["pfc3-tx-pkts"]] = sp_tx_frames
        sinc[:, sc["pfc3-rx-pause-duration-us"]] = sp_rx_us
        sinc[:, sc[SWITCH_TX_PAUSE_DURATION]] = sp_tx_us
        sinc[:, sc["queue3-transmit-pkts"]] = rdma_out_p
        sinc[:, sc["queue3-transmit-octets"]] = rdma_out
        frng = self._fec_rng
        line_up = fs.sp_up_frac.copy()
        line_up[dl] *= fs.up_frac[q]
        # FEC decodes the line, idle or busy: errored bits at the port's BER, about one per codeword
        errored_bits = self._sp_nominal_gbps * 1e9 * dt * line_up * self._sp_ber
        sinc[:, sc["in-fec-correctable-frames"]] = frng.poisson(errored_bits)
        fec_lost = np.where(sm, 0.01, 0.0) * dt
        fec_lost[dl] += fs.fec_unc_rate[q] * dt      # the leaf end of a failing NIC cable loses codewords too
        sinc[:, sc["in-fec-uncorrectable-frames"]] = frng.poisson(fec_lost)
        self._queue_counters(fs, sinc, marked, q, dl, rdma_out_p, sp_tx_us, fs.sp_transitions, dt)
        self._sw.add(sinc)
        # switch gauges
        sg = self._sw_gauges
        speed = self._sp_nominal_gbps.copy()
        speed[dl] = np.where(fs.down_now[q], self._sp_nominal_gbps[dl], fs.speed_now[q])
        oper = np.ones(SP)
        oper[dl] = ~fs.down_now[q]
        oper[fs.sp_admin_down_now] = 0.0
        oper[fs.sp_down_now] = 0.0
        if np.any(link):
            li = np.nonzero(link)[0]
            oper[li] = np.where(fs.sp_admin_down_now[li] | fs.sp_admin_down_now[self._sp_peer_sp[li]], 0.0, oper[li])
        # egress queue 3: incast toward the peer, or the peer pausing us while traffic waits
        out_frac = np.clip(rdma_out / np.maximum(self._sp_nominal_gbps * 1e9 / 8 * dt, 1.0), 0, 1)
        paused = sp_rx_us / (dt * 1e6)
        peer_lvl = np.zeros(SP)
        peer_lvl[dl] = lvl[q]
        occ = out_frac * (paused * rng.uniform(0.2, 1.0, SP) * 2e6 + peer_lvl * rng.uniform(0, 1, SP) * 1.5e6
                          + rng.exponential(4e3, SP))
        occ = np.maximum(occ, fs.sw_occ)
        sg[:, 0] = speed
        sg[:, 1] = oper
        sg[:, 2] = np.where(fs.sp_admin_down_now, 0.0, 1.0)
        sg[:, 3] = np.floor(occ * oper)

    def _spread_uplink_traffic(self, fs: _FaultState, rem: np.ndarray, fb, fpk, ab, apk,
                               sw_in, sw_out, sw_in_p, sw_out_p) -> None:
        """Switch-link traffic of the remote flows, each spread over every spine the two leaves
        share and that is up (``ecmp_spread``), with a few per cent of jitter per (leaf, spine)
        and tick; a polarized leaf sends its flows over its hot spines only."""
        SP = self.SP
        la, lb = self._f_la[rem], self._f_lb[rem]
        n_sp = self._lu.shape[1]
        up = fs.sp_up_frac >= 1.0
        jitter = self._ecmp_rng.lognormal(0.0, ECMP_JITTER_SIGMA, self._lu.shape)
        w = np.zeros((len(la), n_sp))
        for c in range(n_sp):
            a, b = self._lu[la, c], self._lu[lb, c]
            ok = (a >= 0) & (b >= 0)
            ok[ok] &= up[a[ok]] & up[b[ok]]
            w[:, c] = np.where(ok, jitter[la, c], 0.0)
        for row, hot in fs.polarized.items():
            mask = np.zeros(n_sp, bool)
            mask[hot] = True
            sel = la == row
            hot_w = np.where(mask[None, :], w[sel], 0.0)
            keep = hot_w.sum(axis=1) > 0           # a flow with no hot spine in common keeps its spread
            w[np.flatnonzero(sel)[keep]] = hot_w[keep]
        w /= np.maximum(w.sum(axis=1, keepdims=True), 1e-12)
        b_, pk_, ab_, apk_ = fb[rem], fpk[rem], ab[rem], apk[rem]
        for c in range(n_sp):
            wc = w[:, c]
            on = wc > 0
            if not on.any():
                continue
            us, ud = self._lu[la[on], c], self._lu[lb[on], c]
            sa, sb = self._sd[la[on], c], self._sd[lb[on], c]
            bb, pp, aa, ap = b_[on] * wc[on], pk_[on] * wc[on], ab_[on] * wc[on], apk_[on] * wc[on]
            sw_out += np.bincount(us, bb, SP) + np.bincount(ud, aa, SP) + np.bincount(sb, bb, SP) + np.bincount(sa, aa, SP)
            sw_in += np.bincount(sa, bb, SP) + np.bincount(sb, aa, SP) + np.bincount(ud, bb, SP) + np.bincount(us, aa, SP)
            sw_out_p += np.bincount(us, pp, SP) + np.bincount(ud, ap, SP) + np.bincount(sb, pp, SP) + np.bincount(sa, ap, SP)
            sw_in_p += np.bincount(sa, pp, SP) + np.bincount(sb, ap, SP) + np.bincount(ud, pp, SP) + np.bincount(us, ap, SP)

    def _congestion_level(self, fs: _FaultState) -> np.ndarray:
        """Each switch's incast level this tick: its episodes, forced up or silenced by faults."""
        if fs.sw_level_floor is None:
            return self._leaf_level
        return np.maximum(self._leaf_level, fs.sw_level_floor) * ~fs.sw_quiet

    def _queue_counters(self, fs: _FaultState, sinc: np.ndarray, marked: np.ndarray, q: np.ndarray,
                        dl: np.ndarray, rdma_out_p: np.ndarray, sp_tx_us: np.ndarray, transitions: np.ndarray,
                        dt: float) -> None:
        """Egress queue 3's ECN marks and queues 3/0's drops, into the switch increments.

        A leaf port facing a NIC marks what its NIC receives marked (the last hop of incast);
        a switch link marks with the congestion its switch pauses for (a healthy switch marks
        as it pauses), scaled down where its marking thresholds sit above XOFF. Every link
        transition loses the frames in flight on each queue; queue 0 drops a little always.
        """
        sc, rng = _SC, self._q_rng
        sw_duty = np.bincount(self._sp_switch, sp_tx_us, len(self._switches)) / np.maximum(
            np.bincount(self._sp_switch, minlength=len(self._switches)), 1) / (dt * 1e6)
        p_mark = np.clip(0.0015 + UPLINK_MARK_PER_DUTY * sw_duty[self._sp_switch], 0.0, 0.3)
        if fs.sw_ecn_factor is not None:
            p_mark = p_mark * fs.sw_ecn_factor[self._sp_switch]
        marks = rdma_out_p * p_mark
        marks[dl] = marked[q]
        sinc[:, sc["queue3-ecn-marked-pkts"]] = marks
        lost = transitions * LINK_EVENT_DROPS
        extra = fs.q_drops if fs.q_drops is not None else np.zeros((self.SP, 2))
        sinc[:, sc["queue3-dropped-pkts"]] = rng.poisson(extra[:, 0] * dt) + lost
        sinc[:, sc["queue0-dropped-pkts"]] = rng.poisson((LOSSY_DROPS_PER_S + extra[:, 1]) * dt) + lost

    def _nic_queue_drops(self, fs: _FaultState, inc: np.ndarray, dt: float) -> None:
        """A NIC's priority-3 receive discards: a link that goes down loses what was in flight."""
        lost = fs.down_events * LINK_EVENT_DROPS
        if fs.nic_q_drops is not None:
            lost = lost + self._q_rng.poisson(fs.nic_q_drops * dt)
        inc[:, _NC["rx_prio3_buf_discard"]] = lost
