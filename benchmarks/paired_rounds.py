"""Paired timing rounds, shared by the benchmark scripts that time functions.

Every round calls every function ``calls`` times, in an order rotated by one
each round, so load that drifts between rounds hits all of them alike; a
ratio is then the median over rounds of the ratio within a round.
"""

import statistics
from typing import Callable, Dict, List


def time_rounds(fns: Dict[str, Callable[[], object]], *, rounds: int,
                calls: int,
                clock: Callable[[], float]) -> Dict[str, List[float]]:
    """Seconds per call of each function, one entry per round."""
    names = list(fns)
    seconds = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = clock()
            for _ in range(calls):
                fns[name]()
            seconds[name].append((clock() - start) / calls)
    return seconds


def median_ratio(seconds: Dict[str, List[float]], name: str,
                 baseline: str) -> float:
    """The median over rounds of name's time over baseline's."""
    return statistics.median(
        s / b for s, b in zip(seconds[name], seconds[baseline]))
