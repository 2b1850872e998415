from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    REQUEST: _ClassVar[Kind]
    RESPONSE: _ClassVar[Kind]
    ERROR: _ClassVar[Kind]
    CANCEL: _ClassVar[Kind]
    CHUNK: _ClassVar[Kind]
    NOTIFY: _ClassVar[Kind]
    SLOTS_READ: _ClassVar[Kind]
    REPLY_CHANNEL: _ClassVar[Kind]
    LINK_OPENING: _ClassVar[Kind]
KIND_UNSPECIFIED: Kind
REQUEST: Kind
RESPONSE: Kind
ERROR: Kind
CANCEL: Kind
CHUNK: Kind
NOTIFY: Kind
SLOTS_READ: Kind
REPLY_CHANNEL: Kind
LINK_OPENING: Kind

class Frame(_message.Message):
    __slots__ = ("envelopes",)
    ENVELOPES_FIELD_NUMBER: _ClassVar[int]
    envelopes: _containers.RepeatedCompositeFieldContainer[Envelope]
    def __init__(self, envelopes: _Optional[_Iterable[_Union[Envelope, _Mapping]]] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("call_id", "kind", "payload", "buffer_sizes", "data", "timeout_seconds", "function", "caller_rank", "shared_buffers", "reply_channel", "link_token", "link_envelopes", "with_value")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    CALLER_RANK_FIELD_NUMBER: _ClassVar[int]
    SHARED_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    REPLY_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LINK_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LINK_ENVELOPES_FIELD_NUMBER: _ClassVar[int]
    WITH_VALUE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    kind: Kind
    payload: bytes
    buffer_sizes: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    timeout_seconds: float
    function: str
    caller_rank: int
    shared_buffers: _containers.RepeatedScalarFieldContainer[str]
    reply_channel: int
    link_token: int
    link_envelopes: int
    with_value: bool
    def __init__(self, call_id: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., payload: _Optional[bytes] = ..., buffer_sizes: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ..., function: _Optional[str] = ..., caller_rank: _Optional[int] = ..., shared_buffers: _Optional[_Iterable[str]] = ..., reply_channel: _Optional[int] = ..., link_token: _Optional[int] = ..., link_envelopes: _Optional[int] = ..., with_value: _Optional[bool] = ...) -> None: ...
