from tandem.v1 import common_pb2 as _common_pb2
from tandem.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineCoreRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "pooling_params", "eos_token_id", "arrival_time", "priority", "cache_salt", "client_index", "external_req_id", "trace_headers", "data_parallel_rank", "timeout_s", "lora_request", "resumable", "generated_token_ids", "kv_transfer_params")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    pooling_params: _common_pb2.PoolingParams
    eos_token_id: int
    arrival_time: float
    priority: int
    cache_salt: str
    client_index: int
    external_req_id: str
    trace_headers: _containers.ScalarMap[str, str]
    data_parallel_rank: int
    timeout_s: float
    lora_request: _common_pb2.LoRARequest
    resumable: bool
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_transfer_params: _kv_transfer_pb2.KvTransferParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., pooling_params: _Optional[_Union[_common_pb2.PoolingParams, _Mapping]] = ..., eos_token_id: _Optional[int] = ..., arrival_time: _Optional[float] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., client_index: _Optional[int] = ..., external_req_id: _Optional[str] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., data_parallel_rank: _Optional[int] = ..., timeout_s: _Optional[float] = ..., lora_request: _Optional[_Union[_common_pb2.LoRARequest, _Mapping]] = ..., resumable: _Optional[bool] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., kv_transfer_params: _Optional[_Union[_kv_transfer_pb2.KvTransferParams, _Mapping]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class UtilityValue(_message.Message):
    __slots__ = ("int_value", "float_value", "string_value", "bool_value", "bytes_value", "list_value", "lora_request")
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    BYTES_VALUE_FIELD_NUMBER: _ClassVar[int]
    LIST_VALUE_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    int_value: int
    float_value: float
    string_value: str
    bool_value: bool
    bytes_value: bytes
    list_value: UtilityValueList
    lora_request: _common_pb2.LoRARequest
    def __init__(self, int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., string_value: _Optional[str] = ..., bool_value: _Optional[bool] = ..., bytes_value: _Optional[bytes] = ..., list_value: _Optional[_Union[UtilityValueList, _Mapping]] = ..., lora_request: _Optional[_Union[_common_pb2.LoRARequest, _Mapping]] = ...) -> None: ...

class UtilityValueList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[UtilityValue]
    def __init__(self, values: _Optional[_Iterable[_Union[UtilityValue, _Mapping]]] = ...) -> None: ...

class UtilityCall(_message.Message):
    __slots__ = ("call_id", "method", "args")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    method: str
    args: _containers.RepeatedCompositeFieldContainer[UtilityValue]
    def __init__(self, call_id: _Optional[int] = ..., method: _Optional[str] = ..., args: _Optional[_Iterable[_Union[UtilityValue, _Mapping]]] = ...) -> None: ...

class UtilityOutput(_message.Message):
    __slots__ = ("call_id", "result", "failure_message")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    result: UtilityValue
    failure_message: str
    def __init__(self, call_id: _Optional[int] = ..., result: _Optional[_Union[UtilityValue, _Mapping]] = ..., failure_message: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("client_index", "tokenizer_fingerprint", "output_window")
    CLIENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    client_index: int
    tokenizer_fingerprint: str
    output_window: int
    def __init__(self, client_index: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., output_window: _Optional[int] = ...) -> None: ...

class OutputsAck(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class EngineCoreInput(_message.Message):
    __slots__ = ("add", "abort", "utility", "hello", "ack", "batch")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    UTILITY_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    add: EngineCoreRequest
    abort: AbortRequests
    utility: UtilityCall
    hello: Hello
    ack: OutputsAck
    batch: InputBatch
    def __init__(self, add: _Optional[_Union[EngineCoreRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ..., utility: _Optional[_Union[UtilityCall, _Mapping]] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., ack: _Optional[_Union[OutputsAck, _Mapping]] = ..., batch: _Optional[_Union[InputBatch, _Mapping]] = ...) -> None: ...

class InputBatch(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EngineCoreInput]
    def __init__(self, inputs: _Optional[_Iterable[_Union[EngineCoreInput, _Mapping]]] = ...) -> None: ...

class EngineCoreOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs", "finish_reason", "stop_token_id", "stop_str", "num_cached_tokens", "trace_headers", "error", "pooling_output", "kv_transfer_params")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEW_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POOLING_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _common_pb2.Logprobs
    new_prompt_logprobs: _common_pb2.Logprobs
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    stop_str: str
    num_cached_tokens: int
    trace_headers: _containers.ScalarMap[str, str]
    error: RequestError
    pooling_output: _containers.RepeatedScalarFieldContainer[float]
    kv_transfer_params: _kv_transfer_pb2.KvTransferParams
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., new_prompt_logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_str: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., pooling_output: _Optional[_Iterable[float]] = ..., kv_transfer_params: _Optional[_Union[_kv_transfer_pb2.KvTransferParams, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    retry_after_ms: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class TokenColumns(_message.Message):
    __slots__ = ("request_ids", "num_new_tokens", "new_token_ids", "num_cached_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_free_blocks", "num_total_blocks")
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
    def __init__(self, num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ...) -> None: ...

class EngineDead(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class EngineCoreOutputs(_message.Message):
    __slots__ = ("engine_index", "outputs", "scheduler_stats", "timestamp", "utility_output", "finished_requests", "engine_dead", "token_columns", "draining", "num_steps")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_STATS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    UTILITY_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DEAD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    outputs: _containers.RepeatedCompositeFieldContainer[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    timestamp: float
    utility_output: UtilityOutput
    finished_requests: _containers.RepeatedScalarFieldContainer[str]
    engine_dead: EngineDead
    token_columns: TokenColumns
    draining: bool
    num_steps: int
    def __init__(self, engine_index: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[EngineCoreOutput, _Mapping]]] = ..., scheduler_stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., timestamp: _Optional[float] = ..., utility_output: _Optional[_Union[UtilityOutput, _Mapping]] = ..., finished_requests: _Optional[_Iterable[str]] = ..., engine_dead: _Optional[_Union[EngineDead, _Mapping]] = ..., token_columns: _Optional[_Union[TokenColumns, _Mapping]] = ..., draining: _Optional[bool] = ..., num_steps: _Optional[int] = ...) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEngineInfoResponse(_message.Message):
    __slots__ = ("engine_index", "architecture", "model", "served_model_name", "max_model_len", "vocab_size", "block_size", "num_kv_blocks", "num_free_blocks", "num_running_reqs", "num_waiting_reqs", "tokenizer_fingerprint", "max_logprobs", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "dtype", "device", "draining", "accepts_input_batches", "kv_role", "speculative_config")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_INPUT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    architecture: str
    model: str
    served_model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_free_blocks: int
    num_running_reqs: int
    num_waiting_reqs: int
    tokenizer_fingerprint: str
    max_logprobs: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    dtype: str
    device: str
    draining: bool
    accepts_input_batches: bool
    kv_role: str
    speculative_config: str
    def __init__(self, engine_index: _Optional[int] = ..., architecture: _Optional[str] = ..., model: _Optional[str] = ..., served_model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_logprobs: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., draining: _Optional[bool] = ..., accepts_input_batches: _Optional[bool] = ..., kv_role: _Optional[str] = ..., speculative_config: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("success",)
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    def __init__(self, success: _Optional[bool] = ...) -> None: ...
