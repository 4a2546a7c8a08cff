"""`dflash-ray tune`'s search space as the command line gives it. No Ray here: runtime/jobs/tune.py turns each
dimension into Ray Tune's.

    KEY=V1,V2[,...]          grid: every value, crossed with the other grids, each combination --samples times
    KEY=choice(V1,V2,...)    one of the values per trial, uniformly
    KEY=uniform(LO,HI)       a float in [LO, HI)
    KEY=loguniform(LO,HI)    a float whose logarithm is uniform (learning rates)
    KEY=randint(LO,HI)       an integer in [LO, HI), HI excluded as in Ray Tune

Values are in the overrides' grammar (Hydra's: `null`, `[64,128]`, `bfloat16`); every other override is the
sweep's base config, the same for every trial.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dflash_ray.errors import UserError

RANGES = ("uniform", "loguniform", "randint")
KINDS = ("grid", "choice", *RANGES)
_CALL = re.compile(r"^(choice|uniform|loguniform|randint)\((.*)\)$", re.S)
# keys no trial may set: the runs are named and placed by the sweep, and every trial shares the cluster
_FIXED = ("run.", "cluster.", "+", "~")


@dataclass(frozen=True)
class Dimension:
    key: str
    kind: str                 # one of KINDS
    values: tuple = ()        # grid and choice: the values as given
    low: float = 0.0          # the ranges' bounds
    high: float = 0.0

    def candidates(self) -> list[str]:
        """The values to try before any trial starts (each must compose; each is checked for what it does to
        the target's features): every value of a grid or a choice, a range's two ends."""
        if self.kind in ("grid", "choice"):
            return list(self.values)
        if self.kind == "randint":
            return [format_value(int(self.low)), format_value(int(self.high) - 1)]
        return [format_value(self.low), format_value(self.high)]

    def __str__(self) -> str:
        if self.kind == "grid":
            return f"{self.key}={','.join(self.values)}"
        inner = ",".join(self.values) if self.kind == "choice" else f"{format_value(self.low)},{format_value(self.high)}"
        return f"{self.key}={self.kind}({inner})"


def split_values(text: str) -> list[str]:
    """V1,V2,... split at the commas outside brackets and quotes (a value may be a list: [512,1024])."""
    out, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    out.append(cur)
    return [v.strip() for v in out]


def format_value(value) -> str:
    """A sampled value as an override's value: integers as integers, floats so that they read back the same."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return repr(float(value))


def override(key: str, value) -> str:
    return f"{key}={format_value(value)}"


def _number(text: str, key: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserError(f"tune: '{key}': {what} '{text}' is not a number") from None


def parse_dimension(arg: str) -> Dimension | None:
    """One override -> its Dimension, or None when it is a plain override (one value, no call)."""
    key, eq, text = arg.partition("=")
    if not eq or key.startswith(("+", "~")):
        return None
    text = text.strip()
    call = _CALL.match(text)
    if call is None:
        values = split_values(text)
        if len(values) < 2:
            return None
        dim = Dimension(key, "grid", tuple(values))
    else:
        kind, inner = call.group(1), call.group(2)
        values = split_values(inner)
        if any(v == "" for v in values):
            raise UserError(f"tune: '{arg}': an empty value")
        if kind == "choice":
            if len(values) < 2:
                raise UserError(f"tune: '{arg}': choice needs two values at least")
            dim = Dimension(key, "choice", tuple(values))
        else:
            if len(values) != 2:
                raise UserError(f"tune: '{arg}': {kind} takes two bounds, {kind}(LOW,HIGH)")
            low, high = (_number(v, key, "bound") for v in values)
            if not low < high:
                raise UserError(f"tune: '{arg}': the low bound must be below the high one")
            if kind == "loguniform" and low <= 0:
                raise UserError(f"tune: '{arg}': loguniform needs bounds above 0")
            if kind == "randint" and not (low.is_integer() and high.is_integer()):
                raise UserError(f"tune: '{arg}': randint takes integer bounds")
            dim = Dimension(key, kind, (), low, high)
    if dim.kind in ("grid", "choice") and len(set(dim.values)) != len(dim.values):
        raise UserError(f"tune: '{arg}': a value is given twice")
    if key.startswith(_FIXED) or "/" in key:
        raise UserError(f"tune: '{key}' cannot be searched (the sweep names and places the trials' runs, and every "
                        "trial shares the cluster)")
    return dim


def parse_space(args: list[str]) -> tuple[list[Dimension], list[str]]:
    """The command line's overrides -> (the search space's dimensions in order, the plain overrides). One line
    naming the argument for anything malformed; a key searched twice is refused."""
    dims, rest = [], []
    for arg in args:
        dim = parse_dimension(arg)
        if dim is None:
            rest.append(arg)
            continue
        if any(d.key == dim.key for d in dims):
            raise UserError(f"tune: '{dim.key}' is searched twice")
        dims.append(dim)
    if not dims:
        raise UserError("tune: no search space: give at least one KEY=V1,V2 or KEY=choice(...)/uniform(LO,HI)/"
                        "loguniform(LO,HI)/randint(LO,HI)")
    return dims, rest


def trial_count(dims: list[Dimension], samples: int) -> int:
    """How many trials the space makes: the grids' product, times samples."""
    return math.prod(len(d.values) for d in dims if d.kind == "grid") * samples
