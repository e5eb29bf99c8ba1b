import sys

from bloomery.compiler.cutedsl import main

sys.exit(main())
