"""`python -m moesq_cli` = the `moesq` command (what `--nproc N` starts under torchrun)."""
from .app import main

main()
