"""Subcommands of the `helixserve` CLI, one module each (see helixserve/cli.py)."""
