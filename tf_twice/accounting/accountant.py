"""An RdpAccountant that also composes `TwiceSampledGaussianDpEvent`."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np

from tf_twice.accounting import dp_event as dp_event_lib
from tf_twice.accounting import rdp as rdp_lib

NeighborRel = dp_accounting.NeighboringRelation


class TwiceSamplingRdpAccountant(rdp_privacy_accountant.RdpAccountant):
    """dp_accounting's RDP accountant extended with twice sampling.

    `TwiceSampledGaussianDpEvent` is composed with the exact RDP of
    `twice_sampling_rdp` at the accountant's orders; every other event,
    including `SelfComposedDpEvent`/`ComposedDpEvent` around ours, is handled
    by the parent (which calls back into this method for sub-events).
    `get_epsilon` uses dp_accounting's RDP-to-(epsilon, delta) conversion.

    The RDP curve of each distinct event is cached, so composing one step at
    a time (as a training ledger does) costs O(orders) per step.
    """

    def __init__(self,
                 orders: Optional[Sequence[float]] = None,
                 neighboring_relation: NeighborRel = (
                     NeighborRel.ADD_OR_REMOVE_ONE)):
        if orders is not None:
            orders = rdp_lib.check_orders(orders)
        super().__init__(orders, neighboring_relation)
        self._rdp_cache: Dict[dp_event_lib.TwiceSampledGaussianDpEvent,
                              np.ndarray] = {}

    @property
    def orders(self) -> np.ndarray:
        return self._orders.copy()

    @property
    def rdp(self) -> np.ndarray:
        """The accumulated RDP at `orders`."""
        return self._rdp.copy()

    def _maybe_compose(self, event: dp_accounting.DpEvent, count: int,
                       do_compose: bool):
        if not isinstance(event, dp_event_lib.TwiceSampledGaussianDpEvent):
            return super()._maybe_compose(event, count, do_compose)
        if self._neighboring_relation is not NeighborRel.ADD_OR_REMOVE_ONE:
            return rdp_privacy_accountant.CompositionErrorDetails(
                invalid_event=event,
                error_message=(
                    'TwiceSampledGaussianDpEvent is analysed under '
                    'add-or-remove-one adjacency; neighboring_relation must '
                    f'be ADD_OR_REMOVE_ONE. Found '
                    f'{self._neighboring_relation}.'))
        if do_compose:
            self._rdp += count * self._event_rdp(event)
        return None

    def _event_rdp(self, event) -> np.ndarray:
        if event not in self._rdp_cache:
            self._rdp_cache[event] = rdp_lib.rdp_of_blocks(
                self._orders, event.example_sampling_rate, event.blocks())
        return self._rdp_cache[event]
