from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ReloadModelRequest(_message.Message):
    __slots__ = ("model_name", "model_version")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class ReloadModelResponse(_message.Message):
    __slots__ = ("msg",)
    MSG_FIELD_NUMBER: _ClassVar[int]
    msg: str
    def __init__(self, msg: _Optional[str] = ...) -> None: ...

class TrafficRequest(_message.Message):
    __slots__ = ("model_name", "action", "body")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    action: str
    body: str
    def __init__(self, model_name: _Optional[str] = ..., action: _Optional[str] = ..., body: _Optional[str] = ...) -> None: ...

class CanaryRequest(_message.Message):
    __slots__ = ("model_name", "action", "body")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    action: str
    body: str
    def __init__(self, model_name: _Optional[str] = ..., action: _Optional[str] = ..., body: _Optional[str] = ...) -> None: ...

class ShadowRequest(_message.Message):
    __slots__ = ("model_name", "action", "body")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    action: str
    body: str
    def __init__(self, model_name: _Optional[str] = ..., action: _Optional[str] = ..., body: _Optional[str] = ...) -> None: ...

class TenantsRequest(_message.Message):
    __slots__ = ("action", "tenant_name", "key_id", "body")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TENANT_NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    action: str
    tenant_name: str
    key_id: str
    body: str
    def __init__(self, action: _Optional[str] = ..., tenant_name: _Optional[str] = ..., key_id: _Optional[str] = ..., body: _Optional[str] = ...) -> None: ...

class RolloutResponse(_message.Message):
    __slots__ = ("msg",)
    MSG_FIELD_NUMBER: _ClassVar[int]
    msg: str
    def __init__(self, msg: _Optional[str] = ...) -> None: ...
