import sys

from dflash_ray.cli import console_main

sys.exit(console_main())
