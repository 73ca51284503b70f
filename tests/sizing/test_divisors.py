"""t's candidates are the divisors of a, found by factoring: fast for any 64-bit a, prime or not."""

import time

import pytest

from memcalc.sizing.divisors import divisors


def test_divisors_agree_with_trial_division_for_every_n_up_to_2000():
    for n in range(1, 2001):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n


@pytest.mark.parametrize("n, count", [
    (2**40, 41),
    (2**61 - 1, 2),  # a Mersenne prime
    (2**63 - 25, 2),  # the largest prime below 2^63
    ((2**31 - 1) * (2**31 + 11), 4),  # two 31-bit primes: trial division would take minutes
    ((2**31 - 1) ** 2, 3),
    (2**63 - 1, 96),
])
def test_any_64_bit_size_is_factored_in_well_under_a_second(n, count):
    started = time.monotonic()
    found = divisors(n)
    assert time.monotonic() - started < 1.0
    assert len(found) == count and found == sorted(found) and all(n % d == 0 for d in found)
