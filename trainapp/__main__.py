import sys

from trainapp.cli import main

sys.exit(main())
