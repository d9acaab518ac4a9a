"""bench/goodput_model: the arithmetic behind docs/neuron.md's goodput figures."""

from bench import goodput_model as m

MTBF = 3 * 3600


def test_every_figure_says_where_it_comes_from():
    assert all(c.source and c.seconds >= 0 for c in m.COSTS.values())


def test_spares_lose_least_and_in_place_less_than_recreate():
    lost = {mode: m.goodput(mode, MTBF, 10.0, 200)[1] for mode in ("recreate", "in-place", "spares")}
    assert lost["spares"] < lost["in-place"] < lost["recreate"]
    # a process fault restarted in place restores from memory and pays no image pull
    in_place = m.lost_per_fault("in-place", False, 10.0, 200)
    assert in_place["image"] == 0 and in_place["restore"] == m.COSTS["restore_memory"].seconds


def test_the_goodput_is_one_minus_lost_time_and_stalls():
    ratio, lost = m.goodput("spares", MTBF, 10.0, 200)
    stalls = m.COSTS["save_stall"].seconds / (200 * m.COSTS["step"].seconds)
    assert abs(ratio - (1 - lost / MTBF - stalls)) < 1e-12


def test_the_what_if_chain_only_improves_and_ends_above_the_target():
    what_if, last = {}, 0.0
    for _, change in [("", {}), *m.WHAT_IF]:
        what_if = {**what_if, **change}
        best = max(m.goodput("spares", MTBF, what_if.get("graph", 60.0), n, what_if)[0] for n in range(1, 2001))
        assert best >= last
        last = best
    assert last >= 0.995
    assert m.interval_for(0.995, "recreate", MTBF, 10.0) is None  # as measured, no interval reaches it
