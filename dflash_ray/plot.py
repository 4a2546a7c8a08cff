"""`python -m dflash_ray.plot [overrides]` = `dflash-ray plot`."""
import sys

from dflash_ray.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("plot", sys.argv[1:]))
