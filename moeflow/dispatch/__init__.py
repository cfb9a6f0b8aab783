"""Slot assignment, capacity policy, the dispatcher protocol and the local dispatcher."""

from moeflow.dispatch.capacity import resolve_capacity
from moeflow.dispatch.combine import combine_weights, renormalize_kept, sum_token_rows
from moeflow.dispatch.local import LocalDispatcher
from moeflow.dispatch.protocol import Dispatcher
from moeflow.dispatch.slots import SlotAssignment, assign_slots, priority_order

__all__ = [
    "Dispatcher",
    "LocalDispatcher",
    "resolve_capacity",
    "assign_slots",
    "priority_order",
    "SlotAssignment",
    "combine_weights",
    "renormalize_kept",
    "sum_token_rows",
]
