from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SetRequest(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class SetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "timeout_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    timeout_seconds: float
    def __init__(self, key: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("key", "amount", "client_id", "request_seq", "low_seq")
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LOW_SEQ_FIELD_NUMBER: _ClassVar[int]
    key: str
    amount: int
    client_id: bytes
    request_seq: int
    low_seq: int
    def __init__(self, key: _Optional[str] = ..., amount: _Optional[int] = ..., client_id: _Optional[bytes] = ..., request_seq: _Optional[int] = ..., low_seq: _Optional[int] = ...) -> None: ...

class AddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class CompareSetRequest(_message.Message):
    __slots__ = ("key", "expected", "desired")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    key: str
    expected: bytes
    desired: bytes
    def __init__(self, key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ...) -> None: ...

class CompareSetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("keys", "timeout_seconds")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_seconds: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class WaitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class DeleteKeyRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteKeyResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class NumKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NumKeysResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...
