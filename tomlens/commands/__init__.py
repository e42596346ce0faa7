"""CLI subcommands: each module defines `register(subparsers)` and sets `func` on its parser."""

COMMANDS: tuple[str, ...] = ("models", "stimuli", "behave", "cache", "probe", "pairs", "patch")
