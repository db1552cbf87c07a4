"""vLLM's own HTTP weight-sync client, signed: :class:`SignedHTTPWeightSyncClient`.

A server running aiosync's middleware (:mod:`aiosync.engines.vllm_server_app`) refuses
unsigned requests to vLLM's weight routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ...). Code written
against vLLM's trainer-side API — a ``TrainerWeightTransferEngine`` (NCCL, IPC, ...) driving a
``VLLMWeightSyncClient`` — keeps working against such a server by taking this client in place
of vLLM's ``HTTPVLLMWeightSyncClient``: the same methods and bodies (it *is* that client), each
request signed with the key (:mod:`aiosync.engines.auth`) for the server's current run::

    client = SignedHTTPWeightSyncClient("http://host:8000", key_file="key")
    engine = TrainerWeightTransferEngineFactory.trainer_init(init_info, client=client, source=...)

Synchronous, like vLLM's client (vLLM's trainer engines call it from their own threads). A
refusal is an :class:`~aiosync.errors.AuthenticationError` naming the server and the reason;
after a restart of the server (its run changed) the request is signed again for the new run,
once.
"""

from __future__ import annotations

import json as jsonlib
from typing import Any

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from ..errors import AuthenticationError, ConfigError, TransportError
from .auth import Signer, load_key
from .vllm_server_protocol import HELLO


class SignedHTTPWeightSyncClient(HTTPVLLMWeightSyncClient):
    """vLLM's ``HTTPVLLMWeightSyncClient`` with every request signed (see the module docstring).

    ``key`` / ``key_file``: the server's key (default: ``AIOSYNC_SERVER_KEY_FILE`` or
    ``AIOSYNC_SERVER_KEY``). ``timeout``: bound on each request (seconds). ``client``: an
    ``httpx.Client`` of your own (TLS settings, a test transport); it stays yours to close.
    """

    def __init__(self, base_url: str, *, key: str | bytes | None = None, key_file: str | None = None,
                 timeout: float = 300.0, client: Any = None) -> None:
        super().__init__(base_url, timeout)
        key = load_key(key, key_file)
        if key is None:
            raise ConfigError("SignedHTTPWeightSyncClient needs the server's key: key=, key_file=, or "
                              "AIOSYNC_SERVER_KEY_FILE")
        self.signer = Signer(key)
        self.server: str | None = None
        self._client, self._own_client = client, client is None

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.Client(timeout=self.timeout)
        return self._client

    def _hello(self) -> str:
        response = self._http().get(self.base_url + HELLO, timeout=self.timeout)
        if response.status_code != 200:
            raise ConfigError(f"{self.base_url} answered GET {HELLO} with {response.status_code}: start vllm serve "
                              "with --middleware aiosync.engines.vllm_server_app.AiosyncApp")
        self.server = response.json()["server"]
        return self.server

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        route = "/" + path.lstrip("/")
        body = b"" if json is None else jsonlib.dumps(json).encode()
        for attempt in (0, 1):
            server = self.server or self._hello()
            headers = self.signer.sign("POST", route, server, body)
            response = self._http().post(self.base_url + route, content=body, timeout=self.timeout,
                                         headers={**headers, "content-type": "application/json"})
            if response.status_code == 401:
                info = _json_or_empty(response)
                if info.get("reason") == "other_server" and attempt == 0:
                    self.server = None  # the server restarted: sign for its new run
                    continue
                raise AuthenticationError(f"the vLLM server at {self.base_url} refused POST {route}: "
                                          f"{info.get('error', response.text)}", reason=info.get("reason", "unknown"))
            if response.status_code != 200:
                raise TransportError(f"the vLLM server at {self.base_url} answered POST {route} with "
                                     f"{response.status_code}: {response.text[:300]}")
            return

    def close(self) -> None:
        """Close the HTTP client this object made (one given as ``client=`` stays open)."""
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None


def _json_or_empty(response: Any) -> dict:
    try:
        info = response.json()
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}
