from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DebugInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerState(_message.Message):
    __slots__ = ("name", "rank", "state", "carrier", "seconds_since_heard")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CARRIER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    state: str
    carrier: str
    seconds_since_heard: float
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., state: _Optional[str] = ..., carrier: _Optional[str] = ..., seconds_since_heard: _Optional[float] = ...) -> None: ...

class DebugInfoResponse(_message.Message):
    __slots__ = ("name", "rank", "counts", "peers", "metrics_address")
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    counts: _containers.ScalarMap[str, int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerState]
    metrics_address: str
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., counts: _Optional[_Mapping[str, int]] = ..., peers: _Optional[_Iterable[_Union[PeerState, _Mapping]]] = ..., metrics_address: _Optional[str] = ...) -> None: ...
