"""The ``aiosync`` command line: ``demo``, ``bench`` and ``simulate``."""
