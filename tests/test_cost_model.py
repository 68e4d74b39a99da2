"""The alpha-beta-gamma cost model of refimpl.parallel.collectives (no MPI run needed)."""
import pytest
from hypothesis import given, strategies as st

from refimpl.parallel.allreduce import ALGORITHMS, configurations, default_group_size, predicted_time

A, B, G = 1.0, 0.01, 0.001  # alpha (s), beta (s/byte), gamma (s/byte): easy hand arithmetic


# at least one hand-computed value of every registered algorithm's formula
HAND_COMPUTED = [
    # the cheapest of ring (21.75), recursive doubling (24) and halving-doubling (4 + 15 + 0.75)
    ("native", 4, 1000, {}, 19.75),
    # 2(p-1)a + 2(p-1)/p n b + (p-1)/p n g = 6 + 15 + 0.75
    ("ring", 4, 1000, {}, 21.75),
    # lg p (a + n b + n g) = 2 * (1 + 10 + 1)
    ("recursive_doubling", 4, 1000, {}, 24.0),
    # p=5 -> p'=4 plus the fold: 24 + (2a + 2nb + ng) = 24 + 23
    ("recursive_doubling", 5, 1000, {}, 47.0),
    # 2 lg p a + 2 (p-1)/p n b + (p-1)/p n g = 6 + 14 + 0.7
    ("halving_doubling", 8, 800, {}, 20.7),
    # p=6 -> p'=4: 4 + 15 + 0.75 + fold (2 + 20 + 1)
    ("halving_doubling", 6, 1000, {}, 42.75),
    # g=2, q=4: 2a + n b + n g/2 (in group) + 6a + 1.5 (n/2) b + 0.75 (n/2) g (across)
    ("hierarchical", 8, 800, {"group_size": 2}, 2 + 8 + 0.4 + 6 + 6 + 0.3),
    # p=4, k=2: heights 2 -> 4a; busiest rank degree 3, children 2: (3b + 2g) n/k
    ("multicolor", 4, 1000, {"colors": 2}, 4 + (0.03 + 0.002) * 500),
    # k=1, p=3: root has 2 children (degree 2, children 2), leaves degree 1: 2a + (2b + 2g) n
    ("multicolor", 3, 100, {"colors": 1}, 2 + (0.02 + 0.002) * 100),
]


@pytest.mark.parametrize("algorithm,p,n,kw,expected", HAND_COMPUTED)
def test_hand_computed_values(algorithm, p, n, kw, expected):
    assert predicted_time(algorithm, n, p, A, B, G, **kw) == pytest.approx(expected, rel=1e-12)


def test_every_algorithm_has_a_hand_computed_value():
    assert set(ALGORITHMS) <= {case[0] for case in HAND_COMPUTED}


def test_one_rank_costs_nothing():
    for name in ALGORITHMS:
        assert predicted_time(name, 10**6, 1, A, B, G) == 0.0


def test_native_is_the_best_classical_algorithm():
    for p in (2, 3, 4, 7, 8):
        for n in (4, 4096, 2**24):
            best = min(predicted_time(a, n, p, A, B, G) for a in ("ring", "recursive_doubling", "halving_doubling"))
            assert predicted_time("native", n, p, A, B, G) == best


def test_hierarchical_with_trivial_groups_is_a_ring():
    for p in (2, 4, 6):
        ring = predicted_time("ring", 1000, p, A, B, G)
        assert predicted_time("hierarchical", 1000, p, A, B, G, group_size=1) == pytest.approx(ring)
        assert predicted_time("hierarchical", 1000, p, A, B, G, group_size=p) == pytest.approx(ring)


def test_latency_and_bandwidth_regimes():
    """Tiny messages: recursive doubling (lg p messages) beats the ring (2(p-1));
    huge ones: the ring (2(p-1)/p n bytes) beats recursive doubling (lg p n)."""
    assert predicted_time("recursive_doubling", 8, 8, A, B) < predicted_time("ring", 8, 8, A, B)
    assert predicted_time("ring", 10**8, 8, A, B) < predicted_time("recursive_doubling", 10**8, 8, A, B)


@given(config=st.sampled_from(configurations()), p=st.integers(1, 64),
       n=st.integers(0, 2**30), extra=st.integers(1, 2**20))
def test_monotone_in_message_size(config, p, n, extra):
    algorithm, kw = config          # every algorithm with its defaults and each example option value
    t0 = predicted_time(algorithm, n, p, 2e-6, 1e-9, 1e-10, **kw)
    t1 = predicted_time(algorithm, n + extra, p, 2e-6, 1e-9, 1e-10, **kw)
    assert t1 >= t0 >= 0.0
    if p > 1:
        assert t1 > t0


def test_default_group_size_is_a_near_square_divisor():
    assert [default_group_size(p) for p in (1, 2, 4, 6, 8, 9, 12, 7)] == [1, 1, 2, 2, 2, 3, 3, 1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        predicted_time("butterfly", 8, 4, A, B)
    with pytest.raises(ValueError, match="group_size"):
        predicted_time("hierarchical", 8, 6, A, B, group_size=4)
    with pytest.raises(ValueError, match="p must"):
        predicted_time("ring", 8, 0, A, B)
