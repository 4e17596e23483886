"""`python -m atrium_cli` runs the same entry point as the installed `atrium` script."""

import sys

from atrium_cli.main import main

sys.exit(main())
