"""`python -m trainapp`: the command line (trainapp/cli.py); the launch commands are in
trainapp/__init__.py."""

import sys

from trainapp.cli import main
from trainapp.errors import leave

if sys.argv[1:2] == ["train"]:
    leave(main())  # a finished training process leaves at once (trainapp.errors.leave says why)
sys.exit(main())
