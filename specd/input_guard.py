"""Requests that do not parse get INVALID_ARGUMENT naming the field, not INTERNAL.

gRPC answers a request its deserializer cannot parse with INTERNAL ("Exception deserializing
request!"). That is the client's fault, not the server's: the most common case is a string field
holding bytes that are not UTF-8, which protobuf refuses to parse. `InputGuardInterceptor`, which
`build_server` installs on every service, swaps in a deserializer that returns a `Malformed`
marker instead of raising, and makes the method abort with INVALID_ARGUMENT when it meets one
(for streaming requests, at the bad message). `invalid_utf8_field` walks the wire format to name
the offending field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LENGTH, _WIRE_FIXED32 = 0, 1, 2, 5


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]  # IndexError on truncated input: the caller gives up
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def invalid_utf8_field(data: bytes, descriptor: Descriptor, depth: int = 0) -> str | None:
    """The dotted path of the first string field in the serialized message `data` whose bytes are
    not valid UTF-8 (e.g. "messages.messages.content"); None if there is none or the bytes are not
    a well-formed message."""
    if depth > 32:
        return None
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == _WIRE_VARINT:
                _, pos = _varint(data, pos)
            elif wire == _WIRE_FIXED64:
                pos += 8
            elif wire == _WIRE_FIXED32:
                pos += 4
            elif wire == _WIRE_LENGTH:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return field.name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = invalid_utf8_field(chunk, field.message_type, depth + 1)
                    if inner is not None:
                        return f"{field.name}.{inner}"
            else:  # groups: not used by specd's protos
                return None
    except (IndexError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class Malformed:
    """Stands in for a request message that did not parse."""

    message: str


def describe_parse_failure(data: bytes, descriptor: Descriptor | None) -> str:
    """The client-facing reason a request did not parse, naming the field where it can."""
    if descriptor is not None:
        field = invalid_utf8_field(data, descriptor)
        if field is not None:
            return f"{field}: is not valid UTF-8"
        return f"request: not a valid {descriptor.full_name} message"
    return "request: the message does not parse"


def lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserializer` returning `Malformed` instead of raising."""
    cls = getattr(deserializer, "__self__", None)  # generated code passes Message.FromString
    descriptor = getattr(cls, "DESCRIPTOR", None)

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:
            return Malformed(describe_parse_failure(data, descriptor if isinstance(descriptor, Descriptor) else None))

    return parse


def _abort_if_malformed(item: Any, context: grpc.ServicerContext) -> None:
    if isinstance(item, Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.message)


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for item in requests:
        _abort_if_malformed(item, context)
        yield item


def guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a lenient deserializer and a behaviour that refuses `Malformed` requests."""
    if handler.request_deserializer is None:
        return handler
    changes: dict[str, Any] = {"request_deserializer": lenient(handler.request_deserializer)}
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is None:
            continue
        if handler.request_streaming:
            def wrapped(requests: Iterator[Any], context: grpc.ServicerContext, _b: Any = behavior) -> Any:
                return _b(_checked(requests, context), context)
        else:
            def wrapped(request: Any, context: grpc.ServicerContext, _b: Any = behavior) -> Any:
                _abort_if_malformed(request, context)
                return _b(request, context)
        changes[kind] = wrapped
    return handler._replace(**changes)


class InputGuardInterceptor(grpc.ServerInterceptor):
    """Applies `guarded` to every method of the server."""

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        return guarded(handler) if handler is not None else None
