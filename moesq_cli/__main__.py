"""`python -m moesq_cli` = the `moesq` command (what `--nproc N` starts under torchrun)."""
from moesq_cli.app import main

main()
