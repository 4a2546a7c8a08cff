"""`python -m dflash_ray.eval [overrides]` = `dflash-ray eval`."""
import sys

from dflash_ray.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("eval", sys.argv[1:]))
