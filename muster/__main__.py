"""``python -m muster`` runs the command line."""

from muster.cli.main import main

main()
