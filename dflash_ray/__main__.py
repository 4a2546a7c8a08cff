import sys

from dflash_ray.cli import main

sys.exit(main())
