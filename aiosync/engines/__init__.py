"""Inference engines as explorer models (imported only when used; ``import aiosync`` never loads them).

* :mod:`aiosync.engines.vllm` — :class:`~aiosync.engines.vllm.VLLMTarget`: a vLLM engine
  (offline ``LLM`` or ``AsyncLLM``) attached like any other explorer model,
  ``await sync.attach_explorer(name, VLLMTarget(llm))``.
* :mod:`aiosync.engines.vllm_backend` — the ``aiosync`` weight-transfer backend that runs in
  vLLM's workers (registered with vLLM as a plugin, selected by
  ``weight_transfer_config={"backend": "aiosync"}``): every update a transaction, loaded all or
  nothing (:mod:`aiosync.engines.vllm_reload`), checked against the engine's checkpoint
  (:mod:`aiosync.engines.layout`); :mod:`aiosync.engines.vllm_faults` is the same backend with
  faults injected on purpose (``"aiosync-faults"``).

* :mod:`aiosync.engines.vllm_server` — :class:`~aiosync.engines.vllm_server.VLLMServer`: a running
  ``vllm serve`` (with aiosync's middleware, :mod:`aiosync.engines.vllm_server_app`, and a key,
  :mod:`aiosync.engines.auth`) attached the same way; the receiving syncer runs in the server.
  :mod:`aiosync.engines.vllm_signed_client`: vLLM's own HTTP weight-sync client, signed.

An engine target is a :class:`~aiosync.syncers.base.CommitTarget`: the syncers write a host
mapping of the weights in checkpoint names, and the target makes the engine hold what was
written (see docs/engines.md).
"""
