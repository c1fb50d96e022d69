"""KV transfer between engines (disaggregated prefill and decode).

``base.py``: the connector seam (the hooks the scheduler and runner call) and
``NoConnector``; ``grpc_connector.py``: the connector over ``tandem.v1.KvTransfer``;
``held.py``: the producer's held blocks with their expiry; ``blocks.py``: blocks as
bytes; ``service.py``: the producer's gRPC service; ``scheduling.py``: the scheduler's
side (requests waiting for remote KV); ``observe.py``: metrics and spans. Contract:
protos/tandem/v1/kv_transfer.proto; the frontend's routing:
frontend_service/disaggregation.py.
"""

from engine_service.kv_transfer.base import CacheLayout, FinishedLoad, KvConnector, NoConnector

__all__ = ["CacheLayout", "FinishedLoad", "KvConnector", "NoConnector"]
