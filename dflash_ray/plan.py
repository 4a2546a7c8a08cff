"""`python -m dflash_ray.plan [overrides]` = `dflash-ray plan`."""
import sys

from dflash_ray.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("plan", sys.argv[1:]))
