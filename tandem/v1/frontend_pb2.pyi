from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_CONNECTING: _ClassVar[EngineState]
    ENGINE_STATE_SERVING: _ClassVar[EngineState]
    ENGINE_STATE_DRAINING: _ClassVar[EngineState]
    ENGINE_STATE_DEAD: _ClassVar[EngineState]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_CONNECTING: EngineState
ENGINE_STATE_SERVING: EngineState
ENGINE_STATE_DRAINING: EngineState
ENGINE_STATE_DEAD: EngineState

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "chat", "sampling_params", "request_id", "priority", "cache_salt", "add_special_tokens", "add_generation_prompt", "lora_request")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: TokenIds
    chat: ChatMessages
    sampling_params: _common_pb2.SamplingParams
    request_id: str
    priority: int
    cache_salt: str
    add_special_tokens: bool
    add_generation_prompt: bool
    lora_request: _common_pb2.LoRARequest
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., lora_request: _Optional[_Union[_common_pb2.LoRARequest, _Mapping]] = ...) -> None: ...

class DecodedLogprobs(_message.Message):
    __slots__ = ("logprobs", "tokens")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.Logprobs
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class CompletionOutput(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_token_id", "stop_str")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: DecodedLogprobs
    cumulative_logprob: float
    finish_reason: str
    stop_token_id: int
    stop_str: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[DecodedLogprobs, _Mapping]] = ..., cumulative_logprob: _Optional[float] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_str: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "outputs", "prompt_token_ids", "prompt_logprobs", "usage", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[CompletionOutput]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: DecodedLogprobs
    usage: Usage
    finished: bool
    def __init__(self, request_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[CompletionOutput, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Union[DecodedLogprobs, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., finished: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "chat", "add_special_tokens", "add_generation_prompt", "return_token_strings")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strings: bool
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., return_token_strings: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "token_strings", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_strings: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_strings: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "max_model_len", "vocab_size", "max_logprobs", "eos_token_id", "tokenizer_fingerprint", "num_engines")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_ENGINES_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    eos_token_id: int
    tokenizer_fingerprint: str
    num_engines: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., num_engines: _Optional[int] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode", "keep_prefix_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    keep_prefix_cache: bool
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ..., keep_prefix_cache: _Optional[bool] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("address", "index", "state", "num_running_reqs", "num_waiting_reqs", "load_score", "num_in_flight", "detail")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SCORE_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    address: str
    index: int
    state: EngineState
    num_running_reqs: int
    num_waiting_reqs: int
    load_score: int
    num_in_flight: int
    detail: str
    def __init__(self, address: _Optional[str] = ..., index: _Optional[int] = ..., state: _Optional[_Union[EngineState, str]] = ..., num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., load_score: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class AddEngineRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class AddEngineResponse(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: EngineStatus
    def __init__(self, engine: _Optional[_Union[EngineStatus, _Mapping]] = ...) -> None: ...

class RemoveEngineRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RemoveEngineResponse(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: EngineStatus
    def __init__(self, engine: _Optional[_Union[EngineStatus, _Mapping]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("is_sleeping",)
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    is_sleeping: bool
    def __init__(self, is_sleeping: _Optional[bool] = ...) -> None: ...

class FrontendAdminResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FrontendAdminResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_blocks_dropped",)
    NUM_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_dropped: int
    def __init__(self, num_blocks_dropped: _Optional[int] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("trace_paths",)
    TRACE_PATHS_FIELD_NUMBER: _ClassVar[int]
    trace_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trace_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckHealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CollectiveRpcRequest(_message.Message):
    __slots__ = ("method",)
    METHOD_FIELD_NUMBER: _ClassVar[int]
    method: str
    def __init__(self, method: _Optional[str] = ...) -> None: ...

class CollectiveRpcResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, results: _Optional[_Iterable[str]] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "pooling_params", "request_id", "priority", "add_special_tokens")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    pooling_params: _common_pb2.PoolingParams
    request_id: str
    priority: int
    add_special_tokens: bool
    def __init__(self, inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., pooling_params: _Optional[_Union[_common_pb2.PoolingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("index", "embedding", "num_prompt_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    embedding: _containers.RepeatedScalarFieldContainer[float]
    num_prompt_tokens: int
    def __init__(self, index: _Optional[int] = ..., embedding: _Optional[_Iterable[float]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "data", "num_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data: _containers.RepeatedCompositeFieldContainer[Embedding]
    num_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., data: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class AddLoraRequest(_message.Message):
    __slots__ = ("lora_request",)
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    lora_request: _common_pb2.LoRARequest
    def __init__(self, lora_request: _Optional[_Union[_common_pb2.LoRARequest, _Mapping]] = ...) -> None: ...

class AddLoraResponse(_message.Message):
    __slots__ = ("added",)
    ADDED_FIELD_NUMBER: _ClassVar[int]
    added: bool
    def __init__(self, added: _Optional[bool] = ...) -> None: ...

class RemoveLoraRequest(_message.Message):
    __slots__ = ("lora_id",)
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    def __init__(self, lora_id: _Optional[int] = ...) -> None: ...

class RemoveLoraResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ListLorasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLorasResponse(_message.Message):
    __slots__ = ("loras", "engine_lora_ids")
    LORAS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LORA_IDS_FIELD_NUMBER: _ClassVar[int]
    loras: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoRARequest]
    engine_lora_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, loras: _Optional[_Iterable[_Union[_common_pb2.LoRARequest, _Mapping]]] = ..., engine_lora_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PinLoraRequest(_message.Message):
    __slots__ = ("lora_id",)
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    def __init__(self, lora_id: _Optional[int] = ...) -> None: ...

class PinLoraResponse(_message.Message):
    __slots__ = ("pinned",)
    PINNED_FIELD_NUMBER: _ClassVar[int]
    pinned: bool
    def __init__(self, pinned: _Optional[bool] = ...) -> None: ...

class GenerateSessionRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "sampling_params", "request_id", "add_special_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: TokenIds
    sampling_params: _common_pb2.SamplingParams
    request_id: str
    add_special_tokens: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateSessionResponse(_message.Message):
    __slots__ = ("response", "turn")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    response: GenerateResponse
    turn: int
    def __init__(self, response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., turn: _Optional[int] = ...) -> None: ...
