"""Rate derivation from raw totals: wrap, reset, saturation, order, duplicates."""
import numpy as np
import pytest

from fabricwatch.models.frames import EntityFrame
from fabricwatch.models.rates import RateTracker

S = 1_000_000_000


def frame(names, rows):
    rows = np.array(rows, dtype=np.uint64)
    ids = tuple(f"mlx5_{i}/1" for i in range(len(rows)))
    return EntityFrame("nic_port", ids, tuple(names), rows, (), np.empty((len(rows), 0)), [{} for _ in ids])


def test_units_are_applied_per_counter():
    t = RateTracker()
    names = ("port_xmit_data", "tx_prio3_pause_duration", "tx_prio3_pause")
    t.update("n", frame(names, [[0, 0, 0]]), 0)
    f = frame(names, [[1_000, 500_000, 7]], )
    assert t.update("n", f, S // 2)   # half a second later
    xmit_bytes_s, duty, frames_s = f.rates[0]
    assert xmit_bytes_s == pytest.approx(1_000 * 4 / 0.5)   # words -> bytes
    assert duty == pytest.approx(1.0)                        # 0.5 s paused in 0.5 s
    assert frames_s == pytest.approx(14)


def test_elapsed_time_is_real_not_nominal():
    t = RateTracker()
    t.update("n", frame(["tx_prio3_pause"], [[0]]), 0)
    f = frame(["tx_prio3_pause"], [[300]])
    t.update("n", f, 3 * S)   # a late poll: 3 s, not the nominal 1 s
    assert f.rates[0, 0] == pytest.approx(100)
    assert f.dt_s == pytest.approx(3)


def test_32bit_wrap_is_a_wrap():
    t = RateTracker()
    t.update("n", frame(["out_of_buffer"], [[2**32 - 10]]), 0)
    f = frame(["out_of_buffer"], [[5]])
    t.update("n", f, S)
    assert f.rates[0, 0] == pytest.approx(15)
    assert t.stats["counter_wraps"] == 1


def test_64bit_decrease_is_a_reset_with_no_rate():
    t = RateTracker()
    t.update("n", frame(["port_xmit_data", "tx_prio3_pause"], [[10**12, 10**6]]), 0)
    f = frame(["port_xmit_data", "tx_prio3_pause"], [[1000, 3]])   # node rebooted
    t.update("n", f, S)
    assert np.isnan(f.rates).all()
    assert t.stats["counter_resets"] == 2
    # and the next interval is a normal rate again
    g = frame(["port_xmit_data", "tx_prio3_pause"], [[2000, 5]])
    t.update("n", g, 2 * S)
    assert g.rates[0].tolist() == pytest.approx([4000, 2])


def test_32bit_large_drop_is_a_reset_not_a_wrap():
    t = RateTracker()
    t.update("n", frame(["out_of_buffer"], [[1000]]), 0)
    f = frame(["out_of_buffer"], [[3]])
    t.update("n", f, S)
    assert np.isnan(f.rates[0, 0])
    assert t.stats["counter_resets"] == 1


def test_saturated_ib_error_counter_gives_no_rate():
    t = RateTracker()
    t.update("n", frame(["link_downed", "symbol_error"], [[250, 100]]), 0)
    f = frame(["link_downed", "symbol_error"], [[255, 101]])    # 8-bit link_downed pinned at 255
    t.update("n", f, S)
    assert np.isnan(f.rates[0, 0])
    assert f.rates[0, 1] == pytest.approx(1)
    assert t.stats["saturated_counters"] == 1


def test_duplicate_and_out_of_order_samples_are_refused_and_counted():
    t = RateTracker()
    t.update("n", frame(["tx_prio3_pause"], [[0]]), 0)
    t.update("n", frame(["tx_prio3_pause"], [[100]]), 2 * S)
    dup = frame(["tx_prio3_pause"], [[100]])
    late = frame(["tx_prio3_pause"], [[50]])
    assert t.update("n", dup, 2 * S) is False
    assert t.update("n", late, S) is False
    assert t.stats["stale_samples"] == 2
    nxt = frame(["tx_prio3_pause"], [[130]])
    t.update("n", nxt, 3 * S)
    assert nxt.rates[0, 0] == pytest.approx(30)   # state untouched by the refused ones


def test_vectorised_over_entities_and_sources_kept_apart():
    t = RateTracker()
    t.update("a", frame(["tx_prio3_pause"], [[0], [0]]), 0)
    t.update("b", frame(["tx_prio3_pause"], [[0], [0]]), 0)
    fa = frame(["tx_prio3_pause"], [[10], [20]])
    fb = frame(["tx_prio3_pause"], [[1], [2]])
    t.update("a", fa, S)
    t.update("b", fb, S)
    assert fa.rates[:, 0].tolist() == [10, 20]
    assert fb.rates[:, 0].tolist() == [1, 2]


def test_port_xmit_wait_saturates_pinned_is_unknown_never_zero():
    """PortXmitWait is a 32-bit PortCounter: it stops at all ones (IBA 1.8 §16.1.3.5)."""
    pinned = 2**32 - 1
    t = RateTracker()
    t.update("n", frame(["port_xmit_wait"], [[pinned]]), 0)
    f = frame(["port_xmit_wait"], [[pinned]])                   # pinned: no change, yet not "zero"
    t.update("n", f, S)
    assert np.isnan(f.rates[0, 0])
    assert t.stats["saturated_counters"] == 1 and t.stats["counter_saturations"] == 0
    assert t.stats["counter_wraps"] == 0


def test_counter_reaching_all_ones_mid_interval_is_unknown_not_a_partial_rate():
    t = RateTracker()
    t.update("n", frame(["port_xmit_wait", "symbol_error"], [[2**32 - 5_000, 65_000]]), 0)
    f = frame(["port_xmit_wait", "symbol_error"], [[2**32 - 1, 65_535]])   # both got stuck at all-ones
    t.update("n", f, S)
    assert np.isnan(f.rates[0]).all()
    assert t.stats["counter_saturations"] == 2 and t.stats["saturated_counters"] == 2
    cleared = frame(["port_xmit_wait", "symbol_error"], [[10, 0]])          # perfquery -R: a reset
    t.update("n", cleared, 2 * S)
    assert np.isnan(cleared.rates[0]).all() and t.stats["counter_resets"] == 2 and t.stats["counter_wraps"] == 0
    after = frame(["port_xmit_wait", "symbol_error"], [[1_010, 2]])
    t.update("n", after, 3 * S)
    assert after.rates[0].tolist() == [1_000, 2]


def test_saturation_in_a_stacked_group_is_unknown_too():
    from fabricwatch.models.frames import FrameStack
    t = RateTracker()
    cur = np.array([[[2**32 - 3]], [[2**32 - 1]], [[2**32 - 1]]], dtype=np.uint64)
    stack = FrameStack("nic_port", ("mlx5_0/1",), ("port_xmit_wait",), (), np.zeros(3, np.intp), cur,
                       np.empty((3, 1, 0)), times_ns=np.array([0, S, 2 * S]))
    t.update_stack("n", stack)
    assert np.isnan(stack.rates[:, 0, 0]).all()
    assert t.stats["counter_saturations"] == 1 and t.stats["saturated_counters"] == 2


def test_sequence_error_counters_wrap_and_declared_semantics_follow_the_driver_docs():
    from fabricwatch.counters import Overflow, spec_for
    for name, width in (("port_xmit_wait", 32), ("symbol_error", 16), ("link_downed", 8),
                        ("local_link_integrity_errors", 4)):
        assert (spec_for(name).width_bits, spec_for(name).overflow) == (width, Overflow.SATURATE), name
    for name in ("out_of_sequence", "packet_seq_err"):
        assert (spec_for(name).width_bits, spec_for(name).overflow) == (32, Overflow.WRAP), name
    for name in ("port_xmit_data", "rx_prio3_pause_duration", "pfc3-tx-pause-duration-us"):
        assert (spec_for(name).width_bits, spec_for(name).overflow) == (64, Overflow.WRAP), name
    assert spec_for("pfc3-tx-pause-duration-us").rate_unit == "s/s"
    t = RateTracker()
    t.update("n", frame(["out_of_sequence"], [[2**32 - 10]]), 0)
    f = frame(["out_of_sequence"], [[5]])
    t.update("n", f, S)
    assert f.rates[0, 0] == 15 and t.stats["counter_wraps"] == 1
