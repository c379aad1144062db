"""`python -m trainapp`: the command line (trainapp/cli.py); the launch commands are in trainapp/__init__.py."""

import logging
import os
import sys

from trainapp.cli import main

code = main()
if sys.argv[1:2] == ["train"]:
    # A finished training process leaves at once: its snapshots are on disk, its metrics closed and its
    # process group destroyed. The interpreter's own teardown then has nothing left to do but run
    # torch's C++ destructors, and one of them sometimes aborts a finished rank ("terminate called
    # without an active exception", about 1 run in 10 with snapshot.async=true under torchrun), which
    # turns a finished run into a failed one for the launcher.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
sys.exit(code)
