import sys

from csa2.cli import main

sys.exit(main())
