from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]
    POOLING_TYPE_CLS: _ClassVar[PoolingType]

class OutputKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_KIND_UNSPECIFIED: _ClassVar[OutputKind]
    OUTPUT_KIND_CUMULATIVE: _ClassVar[OutputKind]
    OUTPUT_KIND_DELTA: _ClassVar[OutputKind]
    OUTPUT_KIND_FINAL_ONLY: _ClassVar[OutputKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_MEAN: PoolingType
POOLING_TYPE_CLS: PoolingType
OUTPUT_KIND_UNSPECIFIED: OutputKind
OUTPUT_KIND_CUMULATIVE: OutputKind
OUTPUT_KIND_DELTA: OutputKind
OUTPUT_KIND_FINAL_ONLY: OutputKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "prompt_logprobs", "skip_special_tokens", "output_kind", "structured_outputs", "detokenize", "speculative")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_KIND_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    output_kind: OutputKind
    structured_outputs: StructuredOutputs
    detokenize: bool
    speculative: bool
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., output_kind: _Optional[_Union[OutputKind, str]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., detokenize: _Optional[bool] = ..., speculative: _Optional[bool] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: ChoiceList
    grammar: str
    json_object: bool
    structural_tag: str
    disable_any_whitespace: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("task", "pooling_type", "normalize", "dimensions")
    TASK_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    task: str
    pooling_type: PoolingType
    normalize: bool
    dimensions: int
    def __init__(self, task: _Optional[str] = ..., pooling_type: _Optional[_Union[PoolingType, str]] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "ranks", "num_columns")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    num_columns: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., num_columns: _Optional[int] = ...) -> None: ...

class LoRARequest(_message.Message):
    __slots__ = ("lora_name", "lora_int_id", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_INT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_int_id: int
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_int_id: _Optional[int] = ..., lora_path: _Optional[str] = ...) -> None: ...
