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
default). A level names a row of this table; the user's arguments make it an
`AmpSettings` (`amp_settings.py`), which is what the rest of keras_mp reads.
Which layer computes in which dtype is `rules.py`'s table.
"""

import dataclasses
import enum

LEVELS = ("O0", "O1", "O2", "O3")
HALF_DTYPES = ("float16", "bfloat16")
# FP8: the matmuls the rules choose in 8 bits, bfloat16 elsewhere (O2, O3).
FLOAT8 = "float8"
FLOAT8_LEVELS = ("O2", "O3")


class Compute(enum.Enum):
    """Which layers a level computes in half."""

    NONE = "none"  # float32 everywhere
    ALLOW = "allow"  # the allow-list and the layers inside it
    DENY = "deny"  # every layer but the deny-list
    ALL = "all"  # every layer


@dataclasses.dataclass(frozen=True)
class Level:
    name: str
    compute: Compute
    half_variables: bool
    # Whether float16 at this level gets dynamic loss scaling by default.
    float16_loss_scale: bool
    keep_batchnorm_fp32_default: bool

    @property
    def computes_in_half(self):
        return self.compute is not Compute.NONE


LEVEL_TABLE = {
    "O0": Level("O0", Compute.NONE, False, False, True),
    "O1": Level("O1", Compute.ALLOW, False, True, True),
    "O2": Level("O2", Compute.DENY, False, True, True),
    "O3": Level("O3", Compute.ALL, True, False, False),
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


def check_half_dtype(dtype, argument="dtype", float8=False):
    """Returns `dtype` as a string if it is a half dtype (or `"float8"`
    where `float8`), else raises."""
    name = getattr(dtype, "name", dtype)
    allowed = HALF_DTYPES + ((FLOAT8,) if float8 else ())
    if not isinstance(name, str) or name not in allowed:
        raise ValueError(
            f"`{argument}` must be one of {', '.join(allowed)}. Received: {argument}={dtype!r}"
        )
    return name


def check_float8_level(level, argument="level", dtype_argument="dtype"):
    """FP8 is a choice of matmuls at the levels that compute in half beyond
    an allow-list: O2 and O3."""
    if level.name not in FLOAT8_LEVELS:
        raise ValueError(
            f"`{dtype_argument}='float8'` needs `{argument}` to be one of "
            f"{', '.join(FLOAT8_LEVELS)} (FP8 matmuls, bfloat16 elsewhere). "
            f"Received: {argument}={level.name!r}, {dtype_argument}='float8'"
        )
