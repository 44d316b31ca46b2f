"""The commands of ``lmctl``, a module per job; ``lmctl/cli.py`` registers them on the app of
``base.py`` in the order help lists them."""
