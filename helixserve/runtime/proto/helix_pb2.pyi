from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Hop(_message.Message):
    __slots__ = ("node", "address", "start_layer", "end_layer")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    start_layer: int
    end_layer: int
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "has_seed", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "min_tokens", "stop_token_ids", "prompt_logprobs", "logit_bias", "structured_kind", "structured_spec")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_KIND_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_SPEC_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    has_seed: bool
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    structured_kind: str
    structured_spec: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_kind: _Optional[str] = ..., structured_spec: _Optional[str] = ...) -> None: ...

class WorkItem(_message.Message):
    __slots__ = ("request_id", "coordinator_id", "step_id", "hop_index", "route", "position", "token_ids", "hidden", "sampling", "sample", "compute_s", "num_prompt_tokens", "prefix_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    HOP_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    coordinator_id: str
    step_id: int
    hop_index: int
    route: _containers.RepeatedCompositeFieldContainer[Hop]
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden: Tensor
    sampling: SamplingParams
    sample: bool
    compute_s: float
    num_prompt_tokens: int
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., coordinator_id: _Optional[str] = ..., step_id: _Optional[int] = ..., hop_index: _Optional[int] = ..., route: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., sample: _Optional[bool] = ..., compute_s: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., prefix_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamHello(_message.Message):
    __slots__ = ("coordinator_id", "sender", "coordinator_token")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_TOKEN_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    sender: str
    coordinator_token: str
    def __init__(self, coordinator_id: _Optional[str] = ..., sender: _Optional[str] = ..., coordinator_token: _Optional[str] = ...) -> None: ...

class WorkBatch(_message.Message):
    __slots__ = ("hello", "items", "release_ids")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    hello: StreamHello
    items: _containers.RepeatedCompositeFieldContainer[WorkItem]
    release_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hello: _Optional[_Union[StreamHello, _Mapping]] = ..., items: _Optional[_Iterable[_Union[WorkItem, _Mapping]]] = ..., release_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class WorkResult(_message.Message):
    __slots__ = ("request_id", "step_id", "has_token", "token_id", "logprob", "top_logprobs", "status_code", "error", "node", "compute_s", "has_logprob", "prompt_logprobs", "has_prompt_logprobs", "prefix_missing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MISSING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    step_id: int
    has_token: bool
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    status_code: int
    error: str
    node: str
    compute_s: float
    has_logprob: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    has_prompt_logprobs: bool
    prefix_missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., step_id: _Optional[int] = ..., has_token: _Optional[bool] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., status_code: _Optional[int] = ..., error: _Optional[str] = ..., node: _Optional[str] = ..., compute_s: _Optional[float] = ..., has_logprob: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ..., has_prompt_logprobs: _Optional[bool] = ..., prefix_missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CacheEvents(_message.Message):
    __slots__ = ("node", "stored", "removed", "reset")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    node: str
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    reset: bool
    def __init__(self, node: _Optional[str] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., reset: _Optional[bool] = ...) -> None: ...

class ResultBatch(_message.Message):
    __slots__ = ("results", "cache")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[WorkResult]
    cache: CacheEvents
    def __init__(self, results: _Optional[_Iterable[_Union[WorkResult, _Mapping]]] = ..., cache: _Optional[_Union[CacheEvents, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids", "coordinator_id", "coordinator_token")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    coordinator_id: str
    coordinator_token: str
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., coordinator_id: _Optional[str] = ..., coordinator_token: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("node", "model", "num_model_layers", "start_layer", "end_layer", "backend", "device", "dtype", "hidden_size", "kv_block_size", "kv_total_blocks", "kv_used_blocks", "kv_capacity_tokens", "queue_len", "last_batch_size", "busy_fraction", "steps", "active_requests", "draining", "eos_token_ids", "items_run", "step_tokens_counts", "step_tokens_sum", "engine", "vllm_version", "wire_version", "work_messages_out", "work_items_out")
    NODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_MODEL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_SUM_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORK_MESSAGES_OUT_FIELD_NUMBER: _ClassVar[int]
    WORK_ITEMS_OUT_FIELD_NUMBER: _ClassVar[int]
    node: str
    model: str
    num_model_layers: int
    start_layer: int
    end_layer: int
    backend: str
    device: str
    dtype: str
    hidden_size: int
    kv_block_size: int
    kv_total_blocks: int
    kv_used_blocks: int
    kv_capacity_tokens: int
    queue_len: int
    last_batch_size: int
    busy_fraction: float
    steps: int
    active_requests: int
    draining: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    items_run: int
    step_tokens_counts: _containers.RepeatedScalarFieldContainer[int]
    step_tokens_sum: int
    engine: str
    vllm_version: str
    wire_version: int
    work_messages_out: int
    work_items_out: int
    def __init__(self, node: _Optional[str] = ..., model: _Optional[str] = ..., num_model_layers: _Optional[int] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., hidden_size: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., queue_len: _Optional[int] = ..., last_batch_size: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., steps: _Optional[int] = ..., active_requests: _Optional[int] = ..., draining: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., items_run: _Optional[int] = ..., step_tokens_counts: _Optional[_Iterable[int]] = ..., step_tokens_sum: _Optional[int] = ..., engine: _Optional[str] = ..., vllm_version: _Optional[str] = ..., wire_version: _Optional[int] = ..., work_messages_out: _Optional[int] = ..., work_items_out: _Optional[int] = ...) -> None: ...

class LoadRangeRequest(_message.Message):
    __slots__ = ("start_layer", "end_layer", "coordinator_id", "coordinator_token")
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_TOKEN_FIELD_NUMBER: _ClassVar[int]
    start_layer: int
    end_layer: int
    coordinator_id: str
    coordinator_token: str
    def __init__(self, start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., coordinator_id: _Optional[str] = ..., coordinator_token: _Optional[str] = ...) -> None: ...

class LoadRangeReply(_message.Message):
    __slots__ = ("start_layer", "end_layer", "load_s", "switch_s", "requests_moved", "layers_loaded")
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    start_layer: int
    end_layer: int
    load_s: float
    switch_s: float
    requests_moved: int
    layers_loaded: int
    def __init__(self, start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., load_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., requests_moved: _Optional[int] = ..., layers_loaded: _Optional[int] = ...) -> None: ...
