"""What every `rlpost` command shares: its exit codes (a contract, :mod:`rlpost.ops.cli`) and the
reading of ``CONFIG [key=value ...]`` beside ``--resume RUN_DIR``."""

from __future__ import annotations

from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def config_or_override(args) -> None:
    """``--resume RUN_DIR key=value``: argparse took the first override for CONFIG."""
    if args.config and "=" in args.config and not Path(args.config).exists():
        args.overrides.insert(0, args.config)
        args.config = None
