"""The remote tier beside the host pool: blocks published to a distributed KV store (Mooncake Store) under
request-scoped keys and fetched back block by block (`mooncake.RemoteTier`)."""

from .admission import admit
from .local_cache import LocalBlockCache, LocalCacheGroup
from .mooncake import RemoteBlocksMissing, RemoteTier, StoreClient, cleanup, connect, local_store
from .publisher import AlreadyPublished, publish, publishing

__all__ = ["RemoteTier", "RemoteBlocksMissing", "StoreClient", "LocalBlockCache", "LocalCacheGroup",
           "connect", "local_store", "publish", "publishing", "admit", "cleanup", "AlreadyPublished"]
