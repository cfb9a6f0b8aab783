"""Slot assignment, capacity policy, and permute/unpermute into a DispatchPlan."""

from moeflow.dispatch.capacity import resolve_capacity
from moeflow.dispatch.local import Dispatcher, LocalDispatcher
from moeflow.dispatch.slots import SlotAssignment, assign_slots, priority_order

__all__ = ["Dispatcher", "LocalDispatcher", "resolve_capacity", "assign_slots", "priority_order", "SlotAssignment"]
