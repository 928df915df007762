"""Small doubles shared by tests: a gRPC error with a status code."""

from __future__ import annotations

import grpc


class FakeRpcError(grpc.RpcError):
    """What a failed gRPC call raises, with the code and details a test chooses."""

    def __init__(self, code: grpc.StatusCode, details: str = "fake"):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
