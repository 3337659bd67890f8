import sys

from csa2.inspect import main

sys.exit(main())
