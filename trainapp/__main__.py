"""`python -m trainapp`: the command line (trainapp/cli.py); the launch commands are in trainapp/__init__.py."""

import sys

from trainapp.cli import main

sys.exit(main())
