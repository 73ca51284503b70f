"""The divisors of a size, found from its prime factors rather than by trying every value below it.

`memcalc fit --solve t` tries each t that divides a, and sizes go up to 2^63, where trial division is far too slow
for a large prime: Pollard's rho (Brent's variant) with deterministic Miller-Rabin factors it in milliseconds.
"""

from __future__ import annotations

from math import gcd, isqrt

# Miller-Rabin with these bases is exact for every n below 3.3 * 10^24, far above 2^64.
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_SMALL_PRIMES = [p for p in range(2, 1000) if all(p % q for q in range(2, isqrt(p) + 1))]


def divisors(n: int) -> list[int]:
    """Every positive divisor of n (n >= 1), in increasing order."""
    found = [1]
    for prime, power in _factor_counts(n).items():
        found = [d * prime**k for d in found for k in range(power + 1)]
    return sorted(found)


def _factor_counts(n: int) -> dict[int, int]:
    """n's prime factorisation as prime -> exponent."""
    counts: dict[int, int] = {}
    for p in _SMALL_PRIMES:  # small factors first: most sizes are powers of two times a little
        while n % p == 0:
            counts[p] = counts.get(p, 0) + 1
            n //= p
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if _is_prime(m):
            counts[m] = counts.get(m, 0) + 1
        else:
            d = _split(m)
            stack += [d, m // d]
    return counts


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for n below 3.3 * 10^24)."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _split(n: int) -> int:
    """A non-trivial factor of the composite odd n (Pollard's rho, Brent's cycle finding)."""
    for c in range(1, n):
        y, m, g, r, q = 2, 128, 1, 1, 1
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g, k = gcd(q, n), k + m
            r *= 2
        if g == n:  # the batch overshot: step back one at a time
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = gcd(abs(x - ys), n)
        if g != n:
            return g
    raise AssertionError(f"no factor found for {n}")  # unreachable for composite n
