import sys

from kvproc.cli import main

sys.exit(main())
