"""``python -m sparsevar`` = the ``sparsevar`` command."""
import sys

from .cli import main

sys.exit(main())
