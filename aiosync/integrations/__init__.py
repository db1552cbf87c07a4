"""Integrations with the engines users already run, each imported only when used.

* :mod:`.ray` — the trainer and explorers as Ray actors (R1, R2): mixins for your own async
  actor classes and a driver helper for actors Ray restarts. Needs ``pip install 'aiosync[ray]'``.

Nothing here is imported by ``import aiosync``; import the submodule you use.
"""
