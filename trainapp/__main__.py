"""`python -m trainapp`: the command line (trainapp/cli.py); the launch commands are in
trainapp/__init__.py."""

import sys

from trainapp.startup import GcPause


def _run() -> None:
    # A training process starts with the cyclic collector paused until its parts are built
    # (trainapp/startup.py): before the imports below, which are most of what it is for.
    pause = GcPause() if sys.argv[1:2] == ["train"] else None
    from trainapp.cli import main
    from trainapp.errors import leave

    if pause is not None:
        leave(main(gc_pause=pause))  # a finished training process leaves at once (trainapp.errors.leave)
    sys.exit(main())


_run()
