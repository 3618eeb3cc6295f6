import sys

from peerstate.cli import main

sys.exit(main())
