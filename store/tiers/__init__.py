"""The tiers a chunk can live in: the local segment tiers of this process (``space``) and
what reaches them (``admission``), and the shared remote tier (``remote``, ``resp``,
``breaker``) as a store sees it (``sharing``)."""
