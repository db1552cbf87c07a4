"""Integrations with the engines users already run, each imported only when used.

* :mod:`.ray` — the trainer and explorers as Ray actors (R1, R2): mixins for your own async
  actor classes and a driver helper for actors Ray restarts. Needs ``pip install 'aiosync[ray]'``.
* :mod:`.vllm_trainer` — the ``aiosync`` backend of vLLM's trainer-side weight-transfer API
  (``TrainerWeightTransferEngine``): code written against it drives a ``vllm serve`` explorer
  with aiosync's patches by naming the backend. Needs vLLM.

* :mod:`.trl` — TRL's online trainers (GRPO, RLOO) with aiosync doing the weight sync, colocate
  or server mode (docs/trl.md). Needs ``pip install 'aiosync[trl]'``.

Nothing here is imported by ``import aiosync``; import the submodule you use.
"""
