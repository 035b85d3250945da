"""The three pools: host full KV (`HostKVPool`), device block summaries (`BlockSummaries`), and the device working
set (`WorkingSet` slots + `SlotMap` + `RecentTokens`). Data only: decisions live in `control`, byte moves in
`memory`."""

from .host_kv import HostKVPool
from .recent import RecentTokens
from .slot_map import Assignment, SlotMap
from .summaries import BlockSummaries
from .working_set import WorkingSet

__all__ = ["HostKVPool", "RecentTokens", "SlotMap", "Assignment", "BlockSummaries", "WorkingSet"]
