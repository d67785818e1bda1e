"""`python -m delaysvc` is the `delaysvc` command."""

from delaysvc.cli import main

main()
