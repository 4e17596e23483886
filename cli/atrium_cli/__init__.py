"""`atrium`: the command-line client of the Atrium portal's JSON API (see docs/api.md).

Standard library only (argparse, urllib), so it installs anywhere Python 3.11 runs. It keeps
one personal access token in the user's config file (mode 0600) and never prints it.
"""

__version__ = "0.1.0"
