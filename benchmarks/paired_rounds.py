"""Paired timing rounds, shared by the benchmark scripts that time functions.

Every round calls every function ``calls`` times, in an order rotated by one
each round, so load that drifts between rounds hits all of them alike; a
ratio is then the median over rounds of the ratio within a round.
"""

import statistics
import time
from typing import Callable, Dict, List

import tensorflow as tf


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


def print_against_baseline(fns: Dict[str, Callable[[], object]], *,
                           baseline: str, heading: str, rounds: int,
                           calls: int, digits: int = 2) -> None:
    """Times TensorFlow functions in paired rounds of CPU time and prints
    ``heading``, then each one's median ms per call and median ratio to
    ``baseline``. Each call waits for its results (``.numpy()``); each
    function is called once first, so that tracing is not timed."""
    synced = {name: (lambda fn=fn: tf.nest.map_structure(
        lambda t: t.numpy(), fn())) for name, fn in fns.items()}
    for call in synced.values():
        call()
    seconds = time_rounds(synced, rounds=rounds, calls=calls,
                          clock=time.process_time)
    print(heading)
    width = max(len(name) for name in fns)
    for name in fns:
        ratio = median_ratio(seconds, name, baseline)
        print(f'  {name:{width}s} {statistics.median(seconds[name]) * 1e3:8.2f}'
              f' ms  {ratio:{digits + 4}.{digits}f}x')
