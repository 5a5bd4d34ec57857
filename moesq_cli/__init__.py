"""The `moesq` command line: a thin Typer app over moesq_core."""
