"""The precision levels O0-O3, as data.

| level | compute                              | variables | BatchNorm        | loss scale |
|-------|--------------------------------------|-----------|------------------|------------|
| O0    | float32                              | float32   | float32          | none       |
| O1    | half on the allow-list and inside it | float32   | float32          | dynamic    |
| O2    | half except the deny-list            | float32   | float32          | dynamic    |
| O3    | half everywhere                      | half      | half unless kept | none       |

(The loss scale is float16's; bfloat16 needs none.) O3's half variables get
float32 master weights in the optimizer unless `master_weights=False`
(`master_weights.py`).

"half" is float16, or bfloat16 (whose range is float32's: no loss scaling by
default). The lists of layers, and the rules at the boundaries between
layers of different dtypes, live in `policies.py`.
"""

import dataclasses

LEVELS = ("O0", "O1", "O2", "O3")
HALF_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Level:
    name: str
    # Which layers compute in half: "none", "allow" (the allow-list only),
    # "deny" (all but the deny-list) or "all".
    half_compute: str
    half_variables: bool
    # Whether float16 at this level gets dynamic loss scaling by default.
    float16_loss_scale: bool
    keep_batchnorm_fp32_default: bool


LEVEL_TABLE = {
    "O0": Level("O0", "none", False, False, True),
    "O1": Level("O1", "allow", False, True, True),
    "O2": Level("O2", "deny", False, True, True),
    "O3": Level("O3", "all", True, False, False),
}


def get_level(level, argument="level", also=()):
    """The `Level` named `level`; a clear error naming `argument` otherwise.

    `also` lists further accepted values the caller handles itself (they are
    only named in the error message).
    """
    if not isinstance(level, str) or level.upper() not in LEVEL_TABLE:
        allowed = ", ".join(LEVELS) + "".join(f" or {a!r}" for a in also)
        raise ValueError(f"`{argument}` must be one of {allowed}. Received: {argument}={level!r}")
    return LEVEL_TABLE[level.upper()]


def check_half_dtype(dtype, argument="dtype"):
    """Returns `dtype` as a string if it is a half dtype, else raises."""
    name = getattr(dtype, "name", dtype)
    if name not in HALF_DTYPES:
        raise ValueError(
            f"`{argument}` must be one of {', '.join(HALF_DTYPES)}. Received: {argument}={dtype!r}"
        )
    return name
