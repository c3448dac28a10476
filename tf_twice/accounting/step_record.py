"""The record of the DP steps a model's weights hold, and which of them a
ledger must charge. TF-free: the train step updates the record in the
weights (`tf_twice.keras.privacy_record`); this module is its arithmetic.

A record is (steps, digest): how many steps ran on the weights and, as two
31-bit words, a digest of the mechanism each of them ran, in order. Each
step of mechanism word w (the event's `event_words`, or a reserved word)
updates each lane of the digest by

    d <- (d * A + w) mod P,         P = 2**31 - 1,

so k steps of one word from digest d give, in closed form,

    A**k d + w (A**k - 1) / (A - 1)  (mod P)               (`extend`),

and the host computes the digest of any history of (event, count) segments
without replaying it. Products stay below 2**62, so int64 arithmetic in the
train step is exact. Two lanes with different multipliers make an accidental
match of two unrelated histories a 2**-62 event (structured ones can match
in both lanes, but only after about 2**31 steps). The digest names
histories; it is not a secret and does not stop forgery (whoever can write
the weights can write any record): it guards documented workflows against
mistakes (a checkpoint beside the wrong state file, steps of another mechanism,
steps on unchecked input).

`steps_to_charge` is the one rule the ledger applies. A ledger whose
history is H (its (event, count) segments, loaded and charged) accepts a
record iff the weights ran the first j steps of H and then k steps of the
ledger's own event, and charges the k steps not yet charged for them:

* a record that extends the one it accepted last by k steps of its event
  (the steps it watched run): k;
* otherwise (its first sight of the weights, or weights reloaded): the
  largest j at which the record is H's first j steps followed by s - j
  steps of its event, charging s - j (0 for a prefix: a rollback, a
  checkpoint of its own history).

Anything else is refused: steps of another mechanism, steps on input no
check showed to be Poisson-sampled (`UNCHECKED_INPUT`), non-private steps
(`NON_PRIVATE`), another run's history, weights set by arithmetic. Either
way the ledger's history then holds every step of the weights' history
(as a multiset of events, which is what RDP composition adds up), so its
epsilon bounds what the weights reveal.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Iterable, NamedTuple, Optional, Sequence, Tuple

__all__ = ['EMPTY', 'MODULUS', 'MULTIPLIERS', 'NON_PRIVATE', 'Record',
           'UNCHECKED_INPUT', 'event_words', 'extend', 'is_valid', 'record_of',
           'refusal', 'steps_to_charge']

MODULUS = 2**31 - 1  # A Mersenne prime: (d * A + w) < 2**62 fits int64.
MULTIPLIERS = (48271, 16807)  # Primitive roots mod MODULUS (MINSTD's).

Words = Tuple[int, int]
# Reserved words, which no event hashes to (event words are >= 3).
UNCHECKED_INPUT: Words = (1, 1)  # A step on input no check showed Poisson.
NON_PRIVATE: Words = (2, 2)  # A step of a non_private config.


class Record(NamedTuple):
    """What a model's weights say ran on them."""
    steps: int
    digest: Words


EMPTY = Record(0, (0, 0))


@functools.lru_cache(maxsize=64)  # A ledger asks at every step.
def event_words(event_key: str) -> Words:
    """The two words of an event (`ledger_state.event_key`), in [3, P)."""
    raw = hashlib.sha256(event_key.encode()).digest()
    return tuple(3 + int.from_bytes(raw[8 * i:8 * i + 8], 'big')
                 % (MODULUS - 3) for i in range(2))


def extend(record: Record, words: Words, count: int) -> Record:
    """`record` after `count` more steps of `words` (closed form)."""
    digest = []
    for d, w, a in zip(record.digest, words, MULTIPLIERS):
        power = pow(a, count, MODULUS)
        geometric = (power - 1) * pow(a - 1, -1, MODULUS)
        digest.append((power * d + w * geometric) % MODULUS)
    return Record(record.steps + count, tuple(digest))


def record_of(history: Iterable[Tuple[Words, int]]) -> Record:
    """The record of a history of (words, count) segments, in order."""
    record = EMPTY
    for words, count in history:
        record = extend(record, words, count)
    return record


def is_valid(record: Record) -> bool:
    """Whether a train step can have written `record`."""
    return record.steps >= 0 and all(0 <= d < MODULUS
                                     for d in record.digest)


def steps_to_charge(history: Iterable[Tuple[Words, int]],
                    last_accepted: Optional[Record], record: Record,
                    words: Words,
                    watched_words: Sequence[Words] = ()) -> Optional[int]:
    """How many steps of `words` a ledger with `history` must charge for
    weights holding `record` (module docstring); None: refused.

    Args:
      history: the ledger's (words, count) segments, in order (iterated
        only when the record does not extend `last_accepted`).
      last_accepted: the record this ledger accepted last for these
        weights (None: none yet).
      record: the weights' record.
      words: the ledger's event's words.
      watched_words: other words the ledger charges as its event when the
        steps extend `last_accepted` (steps it watched run), e.g.
        `UNCHECKED_INPUT` in a fit that opted in to such input.
    """
    if not is_valid(record):
        return None
    if last_accepted is not None and record.steps >= last_accepted.steps:
        ran = record.steps - last_accepted.steps
        if any(extend(last_accepted, w, ran) == record
               for w in (words, *watched_words)):
            return ran
    # Prefix boundaries of the history up to the record's steps, latest
    # first: the weights branched off there, then ran the ledger's event.
    boundaries = []
    position, prefix = 0, EMPTY
    for segment_words, count in history:
        boundaries.append((position, prefix))
        if position + count >= record.steps:
            # The record may end inside this segment: its own prefix.
            boundaries.append((record.steps, extend(
                prefix, segment_words, record.steps - position)))
            break
        prefix = extend(prefix, segment_words, count)
        position += count
    else:
        boundaries.append((position, prefix))
    for position, prefix in reversed(boundaries):
        if extend(prefix, words, record.steps - position) == record:
            return record.steps - position
    return None


def refusal(model_name: str, record: Record, ledger_steps: int) -> str:
    """Why a ledger of `ledger_steps` steps refuses `record`, and what to do
    (`steps_to_charge` returned None)."""
    return (
        f'{model_name}\'s weights hold {record.steps} DP steps that this '
        f'PrivacyLedger ({ledger_steps} steps) cannot account: their record '
        'is not its first steps followed by steps of its event. They ran on '
        'input not checked to be Poisson-sampled (a fit without a '
        'PrivacyLedger on other input), or under another mechanism (a DP '
        'optimizer replaced by a recompile: continue with '
        'PrivacyLedger.from_state(ledger.get_state(), '
        'event=model.dp_event()) before its steps), or they are another '
        'run\'s (weights loaded from it, another run\'s state file, weights '
        'set by arithmetic). Load the state file written with these weights; '
        'if they are a public starting point (their privacy accounted '
        'elsewhere), wrap model.inner_model in a new DPModel.')
