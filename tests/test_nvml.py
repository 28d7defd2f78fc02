"""The node collector's NVML reader against a mocked pynvml: success, slow fields, degrade logic,
Xid events and ``gpu-check``.
"""
from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace
from unittest import mock

import pynvml
import pytest

from helpers import ROCE, nvml_error, recorded_ethtool, rows_by_id

from fabricwatch.collectors.ethtool_stats import EthtoolReader
from fabricwatch.collectors.node import NodeCollector
from fabricwatch.collectors.node_config import NodeConfig
from fabricwatch.collectors.nvml_fields import COUNTER_NAMES, GAUGE_NAMES
from fabricwatch.collectors.nvml_gpu import GpuReader
from fabricwatch.collectors.sysfs_nic import rows_to_blocks
from fabricwatch.protos.v1 import telemetry_pb2 as pb
from fabricwatch.streams.validate import validate_snapshot


# =========================================================================== NVML (mocked pynvml)


class FakeGpus:
    """Per-GPU answers for the pynvml functions GpuReader calls; each is a MagicMock (call counts)."""

    def __init__(self, n=2, links=(0, 1, 2, 3)):
        self.handles = [SimpleNamespace(i=i) for i in range(n)]
        self.links = links
        self.energy = [1_000_000, 2_000_000]
        self.events: list = []
        idx = lambda h: h.i  # noqa: E731

        def nvlink_state(h, link):
            if link not in self.links:
                raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return 0 if (h.i, link) == (1, 3) else 1

        def nvlink_counter(h, link, counter):
            return {pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 10, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: 1,
                    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 100, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: 0}[counter] + link

        def field_values(h, ids):
            """NVLINK_GET_STATE per link and the four error totals, consistent with the per-link calls."""
            totals = {pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                      pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
                      pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
                      pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: pynvml.NVML_NVLINK_ERROR_DL_RECOVERY}
            out = []
            for fid in ids:
                if isinstance(fid, tuple):          # (NVML_FI_DEV_NVLINK_GET_STATE, link)
                    value = SimpleNamespace(uiVal=nvlink_state(h, fid[1]))
                    out.append(SimpleNamespace(nvmlReturn=0, valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, value=value))
                else:
                    total = sum(nvlink_counter(h, link, totals[fid]) for link in self.links)
                    out.append(SimpleNamespace(nvmlReturn=0, valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                                               value=SimpleNamespace(ullVal=total)))
            return out

        def wait(es, timeout_ms):
            if self.events:
                return self.events.pop(0)
            time.sleep(0.01)
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)

        f = {
            "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: n,
            "nvmlDeviceGetHandleByIndex": lambda i: self.handles[i],
            "nvmlDeviceGetUUID": lambda h: f"GPU-0000000{idx(h)}-aaaa-bbbb-cccc-dddddddddddd",
            "nvmlDeviceGetName": lambda h: "NVIDIA H200",
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=f"00000000:{0x1B + 0x28 * idx(h):02X}:00.0".encode()),
            "nvmlDeviceGetNvLinkState": nvlink_state,
            "nvmlDeviceGetNvLinkErrorCounter": nvlink_counter,
            "nvmlDeviceGetFieldValues": field_values,
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=97 - idx(h), memory=40),
            "nvmlDeviceGetClockInfo": lambda h, t: 1980,
            "nvmlDeviceGetMaxClockInfo": lambda h, t: 1980,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x4 if idx(h) else 0,
            "nvmlDeviceGetPowerUsage": lambda h: 612_345,
            "nvmlDeviceGetTemperatureV": lambda h, s: 61 + idx(h),
            "nvmlDeviceGetTemperature": lambda h, s: 99,
            "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetGpuMaxPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16,
            "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
            "nvmlDeviceGetRemappedRows": lambda h: (2, 0, 0, 0),
            "nvmlDeviceGetTotalEccErrors": lambda h, t, c: 7 if t == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0,
            "nvmlDeviceGetPcieReplayCounter": lambda h: 3,
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: self.energy[idx(h)],
            "nvmlEventSetCreate": lambda: "event-set",
            "nvmlDeviceGetSupportedEventTypes": lambda h: 0x8 | 0x1 | 0x2,
            "nvmlDeviceRegisterEvents": lambda h, types, es: None,
            "nvmlEventSetWait": wait,
            "nvmlEventSetFree": lambda es: None,
        }
        self.mocks = {name: mock.MagicMock(side_effect=fn, name=name) for name, fn in f.items()}

    def fail(self, name, code):
        self.mocks[name].side_effect = lambda *a: (_ for _ in ()).throw(nvml_error(code))

    def patch(self):
        return mock.patch.multiple(pynvml, **self.mocks)


def test_nvml_success_reads_every_column_and_label():
    fake = FakeGpus()
    with fake.patch():
        reader = GpuReader(xid_events=False)
        assert reader.open()
        rows = rows_by_id(reader.sample())
        reader.close()
    g0, g1 = rows["gpu0"], rows["gpu1"]
    assert tuple(g0.gauges) == GAUGE_NAMES and tuple(g0.counters) == COUNTER_NAMES
    assert g0.labels == {"uuid": "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", "pci_bdf": "0000:1b:00.0",
                         "name": "NVIDIA H200"}
    assert g1.labels["pci_bdf"] == "0000:43:00.0"
    assert g0.gauges["utilization_gpu_pct"] == 97 and g1.gauges["utilization_gpu_pct"] == 96
    assert g0.gauges["power_mw"] == 612_345 and g0.gauges["temperature_c"] == 61
    assert g1.gauges["clocks_event_reasons"] == 4 and g0.gauges["sm_clock_max_mhz"] == 1980
    assert (g0.gauges["pcie_gen_current"], g0.gauges["pcie_gen_max"], g0.gauges["pcie_width_max"]) == (5, 5, 16)
    assert g0.gauges["remapped_rows_correctable"] == 2 and g0.gauges["remapped_rows_pending"] == 0
    assert g0.counters["ecc_corrected_volatile_total"] == 7 and g0.counters["ecc_uncorrected_volatile_total"] == 0
    assert g0.counters["energy_mj"] == 1_000_000 and g0.counters["pcie_replay_total"] == 3
    # NVLink: 4 links found; sums over links (value + link number in the fake)
    assert g0.counters["nvlink_crc_flit_errors_total"] == 4 * 10 + 6
    assert g0.counters["nvlink_replay_errors_total"] == 4 * 100 + 6
    assert (g0.gauges["nvlink_links_active"], g1.gauges["nvlink_links_active"], g0.gauges["nvlink_links"]) == (4, 3, 4)
    assert not fake.mocks["nvmlDeviceGetTemperature"].called   # the deprecated call only where V is missing
    assert not reader.problems.counts
    # one field-values call per GPU, no per-link counter calls; iterating links gives the same numbers
    assert fake.mocks["nvmlDeviceGetFieldValues"].call_count == 2
    assert not fake.mocks["nvmlDeviceGetNvLinkErrorCounter"].called
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    with fake.patch():
        reader = GpuReader(xid_events=False)
        assert reader.open()
        per_link = rows_by_id(reader.sample())
        reader.close()
    assert per_link["gpu0"].counters == g0.counters and per_link["gpu1"].gauges["nvlink_links_active"] == 3
    assert fake.mocks["nvmlDeviceGetNvLinkErrorCounter"].call_count == 2 * 4 * 4
    blocks = rows_to_blocks(pb.ENTITY_KIND_GPU, rows.values())
    snap = pb.Snapshot(source="node-0001", source_kind=pb.SOURCE_KIND_NODE, time_unix_ns=time.time_ns(), blocks=blocks)
    assert validate_snapshot(snap, time.time_ns()).problems == []


def test_nvml_maxima_are_cached_and_energy_is_optional():
    fake = FakeGpus(n=2, links=())
    with fake.patch():
        reader = GpuReader(xid_events=False, energy=False)
        assert reader.open()
        rows = [reader.sample() for _ in range(3)]
        reader.close()
    assert all(r.gauges["sm_clock_max_mhz"] == 1980 and r.gauges["pcie_width_max"] == 16 for s in rows for r in s)
    assert fake.mocks["nvmlDeviceGetMaxClockInfo"].call_count == 2          # once per GPU, not per sample
    assert fake.mocks["nvmlDeviceGetGpuMaxPcieLinkGeneration"].call_count == 2
    assert fake.mocks["nvmlDeviceGetClockInfo"].call_count == 6              # the current clock every sample
    assert not fake.mocks["nvmlDeviceGetTotalEnergyConsumption"].called
    assert "energy_mj" not in rows[0][0].counters
    assert NodeConfig.from_dict({}).nvml.energy is False                      # the collector's default


SLOW_COUNTERS = ("ecc_corrected_volatile_total", "ecc_uncorrected_volatile_total", "pcie_replay_total",
                 "nvlink_crc_flit_errors_total", "nvlink_crc_data_errors_total", "nvlink_replay_errors_total",
                 "nvlink_recovery_errors_total")


def test_nvml_slow_fields_are_read_every_nth_sample_and_carried_or_left_out_between():
    fake = FakeGpus(n=2)
    remapped = {0: (2, 0, 0, 0), 1: (0, 0, 0, 0)}
    fake.mocks["nvmlDeviceGetRemappedRows"].side_effect = lambda h: remapped[h.i]
    with fake.patch():
        reader = GpuReader(xid_events=False, energy=True, slow_every=4)
        assert reader.open()
        samples = []
        for i in range(9):
            if i == 2:
                remapped[0] = (3, 0, 1, 0)               # a row remapped between two slow reads
            if i == 6:
                fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_UNKNOWN)
            samples.append(rows_by_id(reader.sample()))
        reader.close()
    slow = [i for i, rows in enumerate(samples) if "pcie_replay_total" in rows["gpu0"].counters]
    assert slow == [0, 4, 8]
    for i, rows in enumerate(samples):
        for row in rows.values():
            assert tuple(row.gauges) == GAUGE_NAMES                   # gauges: same layout every sample
            want = COUNTER_NAMES if i in slow else ("energy_mj",)      # slow counters only when read
            assert tuple(row.counters) == want, (i, row.counters)
            assert row.gauges["utilization_gpu_pct"] > 0 and row.gauges["nvlink_links_active"] >= 3
    carried = [rows["gpu0"].gauges["remapped_rows_correctable"] for rows in samples]
    assert carried[:4] == [2.0] * 4 and carried[4:8] == [3.0] * 4     # the last reading until the next
    assert math.isnan(carried[8])                                       # a failed read: NaN
    assert samples[5]["gpu0"].gauges["remapped_rows_pending"] == 1.0
    m = fake.mocks
    assert m["nvmlDeviceGetUtilizationRates"].call_count == m["nvmlDeviceGetPowerUsage"].call_count == 2 * 9
    assert m["nvmlDeviceGetCurrPcieLinkGeneration"].call_count == 2 * 9    # compared with utilisation: fast
    assert m["nvmlDeviceGetTotalEccErrors"].call_count == 2 * 2 * 3
    assert m["nvmlDeviceGetPcieReplayCounter"].call_count == 2 * 3
    assert m["nvmlDeviceGetRemappedRows"].call_count == 2 * 3
    # NVLink: the link states every sample, the four error totals only with the slow fields
    fields_asked = [len(c.args[1]) for c in m["nvmlDeviceGetFieldValues"].call_args_list]
    assert fields_asked == [4 + 4, 4 + 4] + [4, 4] * 3 + [8, 8] + [4, 4] * 3 + [8, 8]
    assert samples[4]["gpu0"].counters["nvlink_replay_errors_total"] == 4 * 100 + 6
    with pytest.raises(ValueError, match="slow_every"):
        GpuReader(slow_every=0)


def test_nvml_slow_fields_on_the_per_link_fallback_read_error_counters_only_when_due():
    fake = FakeGpus(n=1)
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    with fake.patch():
        reader = GpuReader(xid_events=False, energy=False, slow_every=3)
        assert reader.open()
        samples = [reader.sample()[0] for _ in range(4)]
        reader.close()
    assert [tuple(r.counters) for r in samples] == [COUNTER_NAMES[:3] + COUNTER_NAMES[4:], (), (),
                                                    COUNTER_NAMES[:3] + COUNTER_NAMES[4:]]
    assert all(r.gauges["nvlink_links_active"] == 4 for r in samples)
    assert fake.mocks["nvmlDeviceGetNvLinkErrorCounter"].call_count == 2 * 4 * 4      # 2 slow samples
    assert fake.mocks["nvmlDeviceGetNvLinkState"].call_count == pynvml.NVML_NVLINK_MAX_LINKS + 4 * 4   # discovery, then every sample


def test_slow_nvml_counters_keep_exact_deltas_through_the_worker_pipeline():
    """Snapshots of the node collector (GPU blocks with and without the slow counters) through
    the worker's per-source stage: the rate state is kept per layout, so the ECC increase
    between two slow reads is seen once, with its full size, on the next read."""
    from fabricwatch.streams.pipeline import DetectionPipeline

    config = NodeConfig.from_dict({"node_name": "gpu-node-1", "cluster": "c1",
                                   "sources": {"sysfs": False, "ethtool": False}, "nvml": {"slow_fields_s": 5.0}})
    assert config.nvml_slow_every == 5
    fake = FakeGpus(n=2)
    uncorrected = {0: 0, 1: 0}
    fake.mocks["nvmlDeviceGetTotalEccErrors"].side_effect = \
        lambda h, t, c: 7 if t == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else uncorrected[h.i]
    pipeline = DetectionPipeline()
    found, layouts = [], []
    t0 = time.time_ns() - 60 * 10**9
    with fake.patch():
        collector = NodeCollector(config, gpu_reader=GpuReader(xid_events=False, energy=False,
                                                               slow_every=config.nvml_slow_every))
        for tick in range(16):
            if tick == 7:
                uncorrected[1] = 2                       # two uncorrectable errors between reads
            snap = collector.collect({"nvml"})
            snap.time_unix_ns = t0 + tick * 10**9
            assert validate_snapshot(snap, time.time_ns()).problems == []
            layouts.append(tuple(snap.blocks[0].counter_names))
            found += [(tick, f) for f in pipeline.observe(snap).findings]
        collector.close()
    assert [i for i, names in enumerate(layouts) if names] == [0, 5, 10, 15]
    assert set(layouts) == {(), tuple(n for n in COUNTER_NAMES if n != "energy_mj")}
    ecc = [(tick, f) for tick, f in found if f.kind == "gpu_ecc_uncorrectable"]
    assert [(tick, f.entity.device, f.evidence[0].value) for tick, f in ecc] == [(10, "gpu1", 2.0)]


def test_nvml_not_supported_degrades_one_column_reported_once_and_not_called_again(caplog):
    fake = FakeGpus()
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)    # per-link NVLink calls
    fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.fail("nvmlDeviceGetPcieReplayCounter", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.mocks["nvmlDeviceGetNvLinkErrorCounter"].side_effect = lambda h, link, c: (
        (_ for _ in ()).throw(nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED))
        if c == pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA else 5)
    with fake.patch(), caplog.at_level("INFO", logger="fabricwatch.collectors.nvml"):
        reader = GpuReader(xid_events=False)
        assert reader.open()
        first = rows_by_id(reader.sample())
        second = rows_by_id(reader.sample())
        reader.close()
    for rows in (first, second):
        g = rows["gpu0"]
        assert math.isnan(g.gauges["remapped_rows_correctable"]) and math.isnan(g.gauges["remapped_rows_failure"])
        assert "pcie_replay_total" not in g.counters and "nvlink_crc_data_errors_total" not in g.counters
        assert g.counters["nvlink_crc_flit_errors_total"] == 20 and g.gauges["power_mw"] == 612_345
    assert fake.mocks["nvmlDeviceGetRemappedRows"].call_count == 2             # once per GPU, never again
    assert fake.mocks["nvmlDeviceGetPcieReplayCounter"].call_count == 2
    logged = [r.message for r in caplog.records if "nvmlDeviceGetRemappedRows" in r.message]
    assert len(logged) == 2                                                   # one line per GPU
    assert sum("nvlink_crc_data_errors_total" in r.message for r in caplog.records) == 2   # not one per link


def test_nvlink_field_values_that_do_not_answer_every_field_fall_back_to_per_link_calls():
    fake = FakeGpus(n=1)
    good = fake.mocks["nvmlDeviceGetFieldValues"].side_effect

    def partial(h, ids):
        out = good(h, ids)
        out[-1] = SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, valueType=3, value=None)
        return out

    fake.mocks["nvmlDeviceGetFieldValues"].side_effect = partial
    with fake.patch():
        reader = GpuReader(xid_events=False)
        assert reader.open()
        first, second = reader.sample()[0], reader.sample()[0]
        reader.close()
    assert first.counters["nvlink_recovery_errors_total"] == 6 == second.counters["nvlink_recovery_errors_total"]
    assert fake.mocks["nvmlDeviceGetFieldValues"].call_count == 1       # tried once, per link after that
    assert reader.problems.counts["nvml_not_supported"] == 1


def test_nvml_function_not_found_falls_back_for_temperature_and_nans_the_rest():
    fake = FakeGpus(n=1, links=())
    fake.fail("nvmlDeviceGetTemperatureV", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.fail("nvmlDeviceGetGpuMaxPcieLinkGeneration", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    with fake.patch():
        reader = GpuReader(xid_events=False)
        assert reader.open()
        g = reader.sample()[0]
        g2 = reader.sample()[0]
        reader.close()
    assert g.gauges["temperature_c"] == 99 == g2.gauges["temperature_c"]     # nvmlDeviceGetTemperature
    assert fake.mocks["nvmlDeviceGetTemperatureV"].call_count == 1
    assert math.isnan(g.gauges["clocks_event_reasons"]) and math.isnan(g.gauges["pcie_gen_max"])
    assert math.isnan(g.gauges["nvlink_links_active"]) and "nvlink_crc_flit_errors_total" not in g.counters
    assert reader.problems.counts["nvml_not_supported"] >= 4

    # a sensor that is NOT_SUPPORTED by the V call is not asked of the deprecated one
    fake = FakeGpus(n=1, links=())
    fake.fail("nvmlDeviceGetTemperatureV", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with fake.patch():
        reader = GpuReader(xid_events=False)
        reader.open()
        assert math.isnan(reader.sample()[0].gauges["temperature_c"])
        reader.close()
    assert not fake.mocks["nvmlDeviceGetTemperature"].called


def test_nvml_transient_error_is_retried_and_a_missing_binding_function_degrades():
    fake = FakeGpus(n=1, links=())
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_GPU_IS_LOST)
    with fake.patch():
        reader = GpuReader(xid_events=False)
        reader.open()
        assert math.isnan(reader.sample()[0].gauges["power_mw"])
        fake.mocks["nvmlDeviceGetPowerUsage"].side_effect = lambda h: 500_000
        assert reader.sample()[0].gauges["power_mw"] == 500_000
        with mock.patch.object(pynvml, "nvmlDeviceGetTotalEnergyConsumption", new=None):
            assert "energy_mj" not in reader.sample()[0].counters            # an older nvidia-ml-py
        reader.close()
    assert reader.problems.counts["nvml_error"] == 1


def test_no_driver_gives_one_clear_line_and_the_node_keeps_its_nic_sources(caplog):
    with mock.patch.object(pynvml, "nvmlInit", side_effect=nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)):
        reader = GpuReader()
        with caplog.at_level("WARNING"):
            assert reader.open() is False
        assert "libnvidia-ml.so.1 not found" in reader.unavailable and "\n" not in reader.unavailable
        assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1
        config = NodeConfig.from_dict({"node_name": "node-0001", "sysfs_root": str(ROCE)})
        collector = NodeCollector(config, ethtool_reader=EthtoolReader(source=recorded_ethtool()))
    assert collector.gpu is None and "nvml" not in collector.enabled_sources()
    assert "libnvidia-ml.so.1" in collector.nvml_unavailable
    snap = collector.collect()
    assert [b.entity_kind for b in snap.blocks] == [pb.ENTITY_KIND_NIC_PORT] * 2
    collector.close()


def test_xid_events_are_queued_by_the_thread_and_sent_with_the_next_snapshot():
    fake = FakeGpus()
    xid = pynvml.nvmlEventTypeXidCriticalError
    fake.events = [SimpleNamespace(device=fake.handles[1], eventType=xid, eventData=79),
                   SimpleNamespace(device=fake.handles[1], eventType=xid, eventData=79),   # a repeat is a new event
                   SimpleNamespace(device=fake.handles[0], eventType=xid, eventData=48)]
    with fake.patch():
        reader = GpuReader(event_wait_ms=20)
        assert reader.open() and reader.events_running
        assert reader.event_status["registered"] == ["gpu0", "gpu1"]
        config = NodeConfig.from_dict({"node_name": "node-0001", "sysfs_root": str(ROCE)})
        collector = NodeCollector(config, ethtool_reader=EthtoolReader(source=recorded_ethtool()), gpu_reader=reader)
        deadline = time.monotonic() + 5
        while len(reader._events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = collector.collect({"nvml"})
        collector.close()
        assert not reader.events_running
    assert [(e.entity_id, e.kind, e.code) for e in snap.events] == [("gpu1", "xid", 79), ("gpu1", "xid", 79),
                                                                    ("gpu0", "xid", 48)]
    assert all(e.time_unix_ns > 0 and "Xid" in e.detail for e in snap.events)
    assert [b.entity_kind for b in snap.blocks] == [pb.ENTITY_KIND_GPU]
    fake.mocks["nvmlDeviceRegisterEvents"].assert_called()
    fake.mocks["nvmlEventSetFree"].assert_called_once()


def test_xid_not_registered_where_the_gpu_does_not_support_it():
    fake = FakeGpus(n=1)
    fake.mocks["nvmlDeviceGetSupportedEventTypes"].side_effect = lambda h: 0x1 | 0x2     # ECC only
    with fake.patch():
        reader = GpuReader(event_wait_ms=20)
        assert reader.open()
        assert not reader.events_running and reader.event_status["registered"] == []
        assert "lack XID" in reader.event_status["not_supported"][0]
        assert reader.sample()[0].gauges["power_mw"] == 612_345      # sampling unaffected
        reader.close()
    fake.mocks["nvmlDeviceRegisterEvents"].assert_not_called()


def test_gpu_check_report_and_exit_codes(capsys):
    from fabricwatch.collectors import gpu_check

    fake = FakeGpus(n=1)
    fake.mocks["nvmlSystemGetDriverVersion"] = mock.MagicMock(return_value="580.159.04")
    with fake.patch(), mock.patch.object(pynvml, "nvmlSystemGetDriverVersion", fake.mocks["nvmlSystemGetDriverVersion"]):
        report, code = gpu_check.build_report(gap_s=0.01)
    assert code == 0 and report["ok"]
    gpu = report["gpus"][0]
    assert gpu["fields"]["power_mw"] == {"call": "nvmlDeviceGetPowerUsage", "value": 612_345, "us": mock.ANY}
    assert gpu["nvlink_links_found"] == [0, 1, 2, 3] and report["nvml"]["driver_version"] == "580.159.04"
    assert report["xid_events"]["registered"] == ["gpu0"]
    json.dumps(report)                                   # JSON-clean (NaN written as null)
    with mock.patch.object(pynvml, "nvmlInit", side_effect=nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)):
        assert gpu_check.main(["--gap", "0"]) == 3
    assert json.loads(capsys.readouterr().out)["exit_status"] == 3


