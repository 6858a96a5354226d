"""The `longstraw` subcommands, one module each; `cli.py` parses the command line and dispatches."""
