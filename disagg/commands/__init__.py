"""Subcommand modules; each exposes ``add_commands(subparsers)``."""
