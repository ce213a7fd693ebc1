"""The Responses API's stored responses (`store`, `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`):
bounded by count and bytes, each its tenant's, in memory only."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from services.api.errors import ApiError

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 << 20


@dataclass(slots=True)
class StoredResponse:
    tenant: str
    messages: list[dict[str, Any]]  # the conversation, this response's output last; without its instructions
    body: dict[str, Any]  # the response object, as GET answers it
    size: int


class ResponseStore:
    """Stored responses, each its tenant's, at most `max_count` of them and `max_bytes` together: the oldest go
    first. In memory: a restart loses them."""

    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._held: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if stored.size > self.max_bytes:
            return
        self._held[response_id] = stored
        self._bytes += stored.size
        while len(self._held) > self.max_count or self._bytes > self.max_bytes:
            _, dropped = self._held.popitem(last=False)
            self._bytes -= dropped.size

    def get(self, response_id: str, tenant: str) -> StoredResponse:
        """The tenant's stored response; a 404 for any other id (another tenant's included)."""
        held = self._held.get(response_id)
        if held is None or held.tenant != tenant:
            raise ApiError(f"no response with id '{response_id}' is stored", status=404, code="not_found")
        return held

    def delete(self, response_id: str, tenant: str) -> None:
        held = self.get(response_id, tenant)
        del self._held[response_id]
        self._bytes -= held.size
