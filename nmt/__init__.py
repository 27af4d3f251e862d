"""The ``nmt`` command line: one entry point, subcommands provided by each part of the project."""
