"""The trusted side's protocol: the Redis implementation of the queue, the scoring tier's
view of it, and the object store's readers and writers. Only the learner, its scoring
tier and the proxy import this package; only it (and the tier) imports `redis` or `rq`.
A worker never does (a contract `make lint` checks)."""

from protocol.trusted.connect import connect_queue, open_queue
from protocol.trusted.redis_queue import RedisQueue
from protocol.trusted.store import FileStore, S3Store, Store, open_store

__all__ = ["FileStore", "RedisQueue", "S3Store", "Store", "connect_queue", "open_queue", "open_store"]
