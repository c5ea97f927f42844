import sys

from tide.kernels import main

sys.exit(main())
