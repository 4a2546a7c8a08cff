"""`python -m dflash_ray.prepare [overrides]` = `dflash-ray prepare`."""
import sys

from dflash_ray.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("prepare", sys.argv[1:]))
