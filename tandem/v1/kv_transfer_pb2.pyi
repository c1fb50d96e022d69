from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvCacheKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_KIND_UNSPECIFIED: _ClassVar[KvCacheKind]
    KV_CACHE_KIND_KEY: _ClassVar[KvCacheKind]
    KV_CACHE_KIND_VALUE: _ClassVar[KvCacheKind]
KV_CACHE_KIND_UNSPECIFIED: KvCacheKind
KV_CACHE_KIND_KEY: KvCacheKind
KV_CACHE_KIND_VALUE: KvCacheKind

class KvTransferParams(_message.Message):
    __slots__ = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_address", "remote_request_id", "remote_block_ids", "block_hashes", "num_tokens", "block_size", "expires_at", "transfer_secret")
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECRET_FIELD_NUMBER: _ClassVar[int]
    do_remote_decode: bool
    do_remote_prefill: bool
    remote_engine_id: str
    remote_address: str
    remote_request_id: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    block_size: int
    expires_at: float
    transfer_secret: bytes
    def __init__(self, do_remote_decode: _Optional[bool] = ..., do_remote_prefill: _Optional[bool] = ..., remote_engine_id: _Optional[str] = ..., remote_address: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., expires_at: _Optional[float] = ..., transfer_secret: _Optional[bytes] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("remote_request_id", "transfer_secret", "block_ids", "consumer_engine_id", "max_chunk_bytes")
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECRET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    remote_request_id: str
    transfer_secret: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    consumer_engine_id: str
    max_chunk_bytes: int
    def __init__(self, remote_request_id: _Optional[str] = ..., transfer_secret: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., consumer_engine_id: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class KvCacheLayout(_message.Message):
    __slots__ = ("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "layout")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    layout: str
    def __init__(self, dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("layout", "layer", "kind", "first_block", "num_blocks", "data")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layout: KvCacheLayout
    layer: int
    kind: KvCacheKind
    first_block: int
    num_blocks: int
    data: bytes
    def __init__(self, layout: _Optional[_Union[KvCacheLayout, _Mapping]] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[KvCacheKind, str]] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
