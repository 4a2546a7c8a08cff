"""`python -m dflash_ray.export [overrides]` = `dflash-ray export`."""
import sys

from dflash_ray.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("export", sys.argv[1:]))
