"""`python -m trainapp`: the command line (trainapp/cli.py); the launch commands are in
trainapp/__init__.py."""

import sys

from trainapp.launch import startup

if sys.argv[1:2] in (["train"], ["ray"]):
    startup.pause_gc()  # until the parts are built (trainapp/launch/startup.py says why)

from trainapp.cli import main  # noqa: E402  (after the pause: the imports are what it is for)
from trainapp.errors import leave

if sys.argv[1:2] == ["train"]:
    leave(main())  # a finished training process leaves at once (trainapp.errors.leave says why)
sys.exit(main())
