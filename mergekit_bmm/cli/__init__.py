"""Command-line entry points: thin click commands over the library."""
