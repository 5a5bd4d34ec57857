"""The `moesq` command line: a thin Typer app over moesq_core."""
import signal
import sys
from pathlib import Path


def _interrupted_while_starting(signum, frame):
    sys.stderr.write("interrupted (SIGINT) while moesq was starting: nothing was done\n")
    raise SystemExit(130)


def command_started() -> None:
    """From here on SIGINT raises KeyboardInterrupt again, which the command reports with what it saved."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Run as the `moesq` program (its console script, or `python -m moesq_cli` while runpy finds the package), a
# Ctrl-C before a command starts exits 130 with one line instead of a traceback from inside an import.
if Path(sys.argv[0]).name in ("moesq", "-m") and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
