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
