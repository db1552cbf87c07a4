"""Authenticated updates (SPEC E5): one key both sides hold, an HMAC over every request and answer.

A ``vllm serve`` process running aiosync's server side (:mod:`aiosync.engines.vllm_server_app`)
accepts weights only from a trainer that holds its key. Every request that may change anything
carries four headers::

    x-aiosync-server   the server run it is meant for (random at each start; GET /aiosync/hello)
    x-aiosync-client   the sending client (random per VLLMServer)
    x-aiosync-seq      the client's request counter, strictly increasing
    x-aiosync-mac      HMAC-SHA256(key, "aiosync-v1" LF method LF path LF server LF client LF seq LF
                                   body length LF body), hex

and the server checks them before it decodes or writes anything (:meth:`Verifier.check`): no
key configured, no signature (``unsigned``), a signature that does not verify — a wrong key or
an altered message (``bad_signature``) —, one meant for another server run, e.g. a message
recorded before a restart (``other_server``), or a counter not above the client's last
(``replayed``) are each an :class:`~aiosync.errors.AuthenticationError` naming the reason, and
nothing is done. Answers are signed too (``x-aiosync-mac`` = HMAC(key, "aiosync-answer-v1" LF
the request's mac LF status LF body)): a trainer believes what a server says it holds only if
the server holds the key — a refusal as ``other_server`` included. So is the server's run id,
where it travels outside a signed answer (``GET /aiosync/hello``, a completion's
``x-aiosync-server``): the client sends a fresh ``x-aiosync-nonce`` and believes the run only
with ``x-aiosync-server-mac`` (:func:`run_mac`), so a forged or replayed run id cannot make it
think the server restarted.

What it does not do: it does not encrypt (weights and prompts travel in clear: put TLS or a
private network in front), and it guards only the routes that change weights or their label
(the OpenAI routes are vLLM's ``--api-key``'s). See docs/engines.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AuthenticationError, ConfigError

#: Environment variables both sides read the key from (a file is better: no key in ``ps``).
KEY_ENV = "AIOSYNC_SERVER_KEY"
KEY_FILE_ENV = "AIOSYNC_SERVER_KEY_FILE"
#: The shortest key accepted.
MIN_KEY_BYTES = 16
SERVER, CLIENT, SEQ, MAC = "x-aiosync-server", "x-aiosync-client", "x-aiosync-seq", "x-aiosync-mac"
#: A client's fresh random value on a hello or a completion, and the server's signature of its
#: run id (and the answer's versions) over it: ``x-aiosync-server-mac`` = HMAC(key,
#: "aiosync-run-v1" LF nonce LF run LF versions).
NONCE, RUN_MAC = "x-aiosync-nonce", "x-aiosync-server-mac"
_MAX_NONCE = 128
_MAKE_KEY = "python -c 'import secrets; print(secrets.token_hex(32))' > key"


def load_key(key: str | bytes | None = None, key_file: str | os.PathLike | None = None, *,
             env: bool = True) -> bytes | None:
    """The shared key: ``key`` itself, or the contents of ``key_file`` (trailing whitespace
    dropped), or — with neither and ``env`` — the file named by ``AIOSYNC_SERVER_KEY_FILE`` or
    the value of ``AIOSYNC_SERVER_KEY``; ``None`` when there is none. A key shorter than
    :data:`MIN_KEY_BYTES` is a :class:`~aiosync.errors.ConfigError`."""
    if key is not None and key_file is not None:
        raise ConfigError("give the aiosync key or a key file, not both")
    where = "key="
    if key is None and key_file is None and env:
        key_file, key = os.environ.get(KEY_FILE_ENV) or None, os.environ.get(KEY_ENV) or None
        if key_file is not None and key is not None:
            raise ConfigError(f"both {KEY_FILE_ENV} and {KEY_ENV} are set: keep one")
        where = KEY_FILE_ENV if key_file is not None else KEY_ENV
    if key_file is not None:
        try:
            key = Path(key_file).read_bytes().rstrip()
        except OSError as exc:
            raise ConfigError(f"cannot read the aiosync key file {str(key_file)!r}: {exc}") from None
        where = f"the key file {str(key_file)!r}"
    if key is None:
        return None
    key = key.encode() if isinstance(key, str) else bytes(key)
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the aiosync key ({where}) has {len(key)} bytes; use at least {MIN_KEY_BYTES}, e.g. "
                          f"`{_MAKE_KEY}`")
    return key


def request_mac(key: bytes, method: str, path: str, server: str, client: str, seq: int, body: bytes) -> str:
    """The signature of one request (hex). Hashing releases the GIL: run it in a worker thread
    for a large body."""
    mac = hmac.new(key, f"aiosync-v1\n{method.upper()}\n{path}\n{server}\n{client}\n{seq}\n{len(body)}\n".encode(),
                   hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def answer_mac(key: bytes, request: str, status: int, body: bytes) -> str:
    """The signature of the answer to the request signed ``request`` (hex)."""
    mac = hmac.new(key, f"aiosync-answer-v1\n{request}\n{status}\n".encode(), hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def run_mac(key: bytes, nonce: str, server: str, versions: str = "") -> str:
    """The signature of a server run id (and the versions header beside it) sent in answer to
    a request that carried ``nonce`` (hex)."""
    return hmac.new(key, f"aiosync-run-v1\n{nonce}\n{server}\n{versions}".encode(), hashlib.sha256).hexdigest()


@dataclass
class Signer:
    """The trainer's side: signs each request with the next counter, checks each answer."""

    key: bytes
    client: str = field(default_factory=lambda: secrets.token_hex(8))
    seq: int = 0

    def sign(self, method: str, path: str, server: str, body: bytes) -> dict[str, str]:
        """The headers of one request to server run ``server``."""
        self.seq += 1
        return {SERVER: server, CLIENT: self.client, SEQ: str(self.seq),
                MAC: request_mac(self.key, method, path, server, self.client, self.seq, body)}

    def nonce(self) -> dict[str, str]:
        """The header asking a server to sign its run id in the answer (:meth:`signed_run`)."""
        return {NONCE: secrets.token_hex(16)}

    def signed_run(self, request: Mapping[str, str], headers: Mapping[str, str], versions: str = "") -> str | None:
        """The run id ``headers`` name (``x-aiosync-server``), if the server signed it in answer
        to ``request`` (:meth:`nonce`) with this key; ``None`` for a missing or forged one."""
        server = headers.get(SERVER)
        if not server:
            return None
        want = run_mac(self.key, request[NONCE], server, versions)
        return server if hmac.compare_digest(headers.get(RUN_MAC, ""), want) else None

    def check_answer(self, request: Mapping[str, str], status: int, body: bytes, headers: Mapping[str, str]) -> None:
        """Raise :class:`~aiosync.errors.AuthenticationError` unless the answer is signed with this key."""
        got = headers.get(MAC, "")
        if not hmac.compare_digest(got, answer_mac(self.key, request[MAC], status, body)):
            raise AuthenticationError("the server's answer is not signed with this key (another key on the server, or "
                                      "an answer altered on the way): what it reports is not believed",
                                      reason="bad_signature" if got else "unsigned")


@dataclass
class Verifier:
    """The server's side: checks every request before anything is decoded (see the module
    docstring); ``server`` is this run's id. ``refused`` counts refusals by reason."""

    key: bytes | None
    server: str = field(default_factory=lambda: secrets.token_hex(16))
    max_clients: int = 4096
    refused: dict[str, int] = field(default_factory=dict)
    _last: dict[str, int] = field(default_factory=dict, repr=False)

    def expected(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> str:
        """The signature a request with these headers and body must carry ("" when it cannot
        be computed). Pure: hash a large body in a worker thread, then :meth:`check`."""
        server, client, seq = (headers.get(h, "") for h in (SERVER, CLIENT, SEQ))
        try:
            n = int(seq)
        except ValueError:
            return ""
        return request_mac(self.key, method, path, server, client, n, body) if self.key and n > 0 else ""

    def check(self, method: str, path: str, headers: Mapping[str, str], expected: str) -> str:
        """The client id of a request that passes, given its :meth:`expected` signature;
        :class:`~aiosync.errors.AuthenticationError` otherwise. Headers are looked up in lower
        case. Call it where requests are serialised (the event loop): it records the counter."""
        if self.key is None:
            self._refuse("no_key", f"this server has no aiosync key, so it accepts no weights: start it with "
                                   f"{KEY_FILE_ENV}=<a file holding the key> (e.g. `{_MAKE_KEY}`)")
        server, client, seq, mac = (headers.get(h, "") for h in (SERVER, CLIENT, SEQ, MAC))
        if not (server and client and seq and mac):
            self._refuse("unsigned", f"{method} {path} is not signed: this server accepts weights only from a trainer "
                                     "holding its key (VLLMServer(url, key_file=...), or the AIOSYNC_SERVER_KEY_FILE "
                                     "environment variable)")
        if not (expected and hmac.compare_digest(mac, expected)):
            self._refuse("bad_signature", f"{method} {path}: the signature does not verify (the trainer holds another "
                                          "key, or the message was altered on the way)")
        if server != self.server:
            self._refuse("other_server", f"{method} {path} was signed for server run {server[:12]}…, this is run "
                                         f"{self.server[:12]}…: a message from before a restart (a replay?) — "
                                         "ask GET /aiosync/hello for the current run")
        n, last = int(seq), self._last.get(client)
        if last is not None and n <= last:
            self._refuse("replayed", f"{method} {path}: request {n} of client {client} comes after request {last} "
                                     "(a replayed or reordered message)")
        if last is None and len(self._last) >= self.max_clients:
            self._refuse("replayed", f"more than {self.max_clients} trainer clients signed requests to this server run; "
                                     "restart it")
        self._last[client] = n
        return client

    def sign_run(self, request: Mapping[str, str], versions: str = "") -> dict[str, str]:
        """The headers naming this run, signed over the request's nonce (``x-aiosync-nonce``,
        when it has one: :meth:`Signer.nonce`) and ``versions``; ``headers`` are in lower case."""
        out = {SERVER: self.server}
        nonce = request.get(NONCE, "")
        if self.key and nonce and len(nonce) <= _MAX_NONCE:
            out[RUN_MAC] = run_mac(self.key, nonce, self.server, versions)
        return out

    def sign_answer(self, request: Mapping[str, str], status: int, body: bytes) -> dict[str, str]:
        """The header that signs the answer to a request that passed :meth:`check`."""
        return {MAC: answer_mac(self.key, request[MAC], status, body)} if self.key and request.get(MAC) else {}

    def _refuse(self, reason: str, message: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        raise AuthenticationError(f"refused: {message}. Nothing was changed", reason=reason)
