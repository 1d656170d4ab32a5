"""The divisors a message lists as the values to choose among (parallel degrees, kv heads, experts)."""

from __future__ import annotations

import math

# Listed by trial division up to the square root: 10**12 takes 10**6 steps (~0.1 s). A count past it is no model's
# or job's (a mistyped value: --model.heads 1099511627777), and a loop to it hung the config check before its error
LISTED_UP_TO = 10**12


def divisors(n: int) -> list[int] | None:
    """The divisors of n >= 1 in increasing order; None past LISTED_UP_TO (say "a divisor of n" instead)."""
    if n < 1 or n > LISTED_UP_TO:
        return None
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def among(n: int) -> str:
    """`n`'s divisors as a message lists them: "[1, 2, 4]", or "the divisors of n" for a count too large to list."""
    found = divisors(n)
    return str(found) if found is not None else f"the divisors of {n}"
