"""`python -m dflash_ray.order_stats --counts ...` = `dflash-ray order-stats`."""
import sys

from dflash_ray.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("order-stats", sys.argv[1:]))
