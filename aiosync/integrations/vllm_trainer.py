"""vLLM's trainer-side weight-transfer API, with aiosync underneath: the ``aiosync`` backend of
``vllm.distributed.weight_transfer.base.TrainerWeightTransferEngine``.

Code written against vLLM's API switches to aiosync's patches by naming the backend — its init
info — and handing the server's key::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from aiosync.integrations.vllm_trainer import AiosyncTrainerInitInfo    # registers "aiosync"
    from aiosync.engines.vllm_signed_client import SignedHTTPWeightSyncClient

    client = SignedHTTPWeightSyncClient("http://host:8000", key_file="key")
    engine = WeightTransferTrainerFactory.trainer_init(
        AiosyncTrainerInitInfo(rank=rank), client=client, source=ModuleSource(model))  # bootstrap
    for step in ...:
        train_step(model)
        engine.send_weights()        # the patch of this step reaches the server; returns once it serves it
    engine.shutdown()

The server is a ``vllm serve`` started with aiosync's backend and middleware
(:mod:`aiosync.engines.vllm_server_app`). Underneath, :class:`AiosyncTrainerWeightTransferEngine`
is a thin face over a :class:`~aiosync.coordination.Synchronizer` (style ``fixed``) with the
trainer attached over the source's tensors and the server attached as an explorer
(:class:`~aiosync.engines.vllm_server.VLLMServer`), run in an event loop of its own (an anyio
blocking portal: vLLM's API is synchronous). ``send_weights()`` publishes the next version
(1, 2, ...) and returns once the server holds it; a server that restarted is bootstrapped by
the next ``send_weights()``. Every version's bytes are the patch (or the bucket sync) that
aiosync's syncer config names; vLLM's ``/update_weights`` routes are not used.

Multi-rank trainers: rank 0 (``is_sender``) runs the synchronizer and needs the whole
weights from the source (a ``ModuleSource`` over an unsharded module; a source that gathers,
on every rank); the other ranks only iterate the source, so that its collectives stay aligned.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from ..engines.vllm_plugin import BACKEND
from ..errors import ApplyError, ConfigError


@dataclass
class AiosyncTrainerInitInfo(TrainerInitInfo):
    """Init info of the ``aiosync`` trainer backend.

    ``url``: the server's base URL (default: the client's ``base_url``). ``key`` /
    ``key_file``: the server's key (default: a :class:`SignedHTTPWeightSyncClient`'s, else
    ``AIOSYNC_SERVER_KEY_FILE`` / ``AIOSYNC_SERVER_KEY``). ``weight_syncer``: aiosync's
    ``weight_syncer`` config (default: the patch syncer). ``synchronizer``: synchronizer config
    keys over the defaults (style ``fixed``; ``sync_timeout`` and ``delivery_timeout`` =
    ``timeout``; ``liveness_timeout`` a week: the explorer lives in this process and is called
    only by ``send_weights``, however long a train step takes). ``timeout``: bound on each
    request to the server and on each ``send_weights``. ``http_client``: an
    ``httpx.AsyncClient`` of your own for the server (TLS settings); it stays yours to close.
    """

    backend: ClassVar[str] = BACKEND

    url: str | None = None
    key: str | bytes | None = field(default=None, repr=False)
    key_file: str | None = None
    weight_syncer: dict = field(default_factory=lambda: {"type": "patch"})
    synchronizer: dict = field(default_factory=dict)
    timeout: float = 300.0
    http_client: Any = field(default=None, repr=False)


class AiosyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[AiosyncTrainerInitInfo]):
    """The trainer half of vLLM's weight-transfer API over aiosync (see the module docstring).

    ``version``: the version the server holds (0: the bootstrap, then one per
    ``send_weights``). ``server``: the :class:`~aiosync.engines.vllm_server.VLLMServer`;
    ``sync``: the synchronizer (its ``metrics()`` name the server's state).
    """

    init_info_cls = AiosyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.version = 0
        self.server: Any = None
        self.sync: Any = None
        self._state: dict[str, torch.Tensor] = {}
        self._stack: contextlib.ExitStack | None = None
        self._portal: Any = None
        self._timeout = 300.0

    @classmethod
    def trainer_init(cls, init_info: AiosyncTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "AiosyncTrainerWeightTransferEngine":
        """Attach the server (bootstrap: it holds the source's weights as version 0 on return)."""
        if source is None:
            raise ConfigError("the aiosync trainer backend needs a WeightSource (e.g. ModuleSource(model)): it "
                              "sends the source's tensors")
        if not isinstance(init_info, AiosyncTrainerInitInfo):
            raise ConfigError(f"the aiosync trainer backend takes an AiosyncTrainerInitInfo, not "
                              f"{type(init_info).__name__}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            engine._start(init_info)
        else:
            engine._iterate()
        return engine

    def _start(self, info: AiosyncTrainerInitInfo) -> None:
        from anyio.from_thread import start_blocking_portal

        from ..coordination import Synchronizer
        from ..engines.vllm_server import VLLMServer

        url = info.url or getattr(self.client, "base_url", None)
        if not url:
            raise ConfigError("the aiosync trainer backend reaches a vllm serve over HTTP: give "
                              "AiosyncTrainerInitInfo(url=...) or an HTTP client (SignedHTTPWeightSyncClient(url))")
        signer = getattr(self.client, "signer", None)
        key = info.key if info.key is not None or info.key_file is not None else getattr(signer, "key", None)
        self._timeout = info.timeout
        self._state = self._iterate()
        stack = contextlib.ExitStack()
        try:
            self._portal = stack.enter_context(start_blocking_portal())
            self.server = VLLMServer(url, key=key, key_file=info.key_file, timeout=info.timeout,
                                     client=info.http_client)
            stack.callback(self._portal.call, self.server.aclose)
            config = {"style": "fixed", "sync_timeout": info.timeout, "delivery_timeout": info.timeout,
                      "liveness_timeout": 7 * 86400.0, **info.synchronizer}
            self.sync = stack.enter_context(self._portal.wrap_async_context_manager(
                Synchronizer(config, info.weight_syncer)))
            self._trainer = self._portal.call(self.sync.attach_trainer, self._state)
            self._explorer = self._portal.call(self.sync.attach_explorer, "vllm-server", self.server)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def _iterate(self) -> dict[str, torch.Tensor]:
        """One pass over the source (its collectives, on every rank); the sender's copy of the
        weights is updated in place (the synchronizer reads it)."""
        state = self._state
        fresh: dict[str, torch.Tensor] = {}
        for name, tensor in self.source:
            held = state.get(name)
            if held is None:
                fresh[name] = tensor
            elif held.shape != tensor.shape:
                raise ConfigError(f"the source's {name!r} is {tuple(tensor.shape)} now, {tuple(held.shape)} at "
                                  "trainer_init")
            elif held.data_ptr() != tensor.data_ptr():  # a gathered copy, not a view of the same tensor
                held.copy_(tensor)
        if state and fresh:
            raise ConfigError(f"the source gave tensors it did not give at trainer_init: {sorted(fresh)[:5]}")
        return fresh or state

    def send_weights(self) -> None:
        """Publish the source's weights as the next version and return once the server holds
        it (on rank 0; other ranks only iterate the source). A failed update leaves the server
        on its previous version and raises :class:`~aiosync.errors.ApplyError`; the next call
        repairs (a restarted server is bootstrapped)."""
        self._iterate()
        if not self.is_sender:
            return
        if self._stack is None:
            raise ApplyError("the aiosync trainer engine was shut down")
        version, held = self._portal.call(self._send)
        self.version = held
        if held != version:
            line = self.sync.explorers["vllm-server"].statistics()
            raise ApplyError(f"the vLLM server at {self.server.url} did not take version {version} (it holds "
                             f"{held}): {line.last_error}")

    async def _send(self) -> tuple[int, int | None]:
        import anyio

        version = self._trainer.version + 1
        with anyio.fail_after(self._timeout * 2):
            await self._trainer.sync_weight(version)
            held = await self._explorer.sync_weight()
            if held != version and self._explorer.version is None:  # it lost its weights: its repair was asked
                held = await self._explorer.wait_applied()
        return version, held

    def shutdown(self) -> None:
        """Close the synchronizer, the HTTP client and the event loop (the server keeps serving
        the last version it took)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


def register() -> None:
    """Register the ``aiosync`` trainer backend with vLLM's ``WeightTransferTrainerFactory``
    (done when this module is imported; safe to call again)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, AiosyncTrainerWeightTransferEngine)


register()
