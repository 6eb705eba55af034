"""cpa: a research workbench for paged-attention decode kernels.

Importing ``cpa`` is light: torch and the pure-Python/torch submodules below, nothing that
compiles, profiles or plots.
"""

__version__ = "0.1.0"

# ---- reference side: pure torch ------------------------------------------------------------
from . import validation, reference, inputs  # noqa: E402
from .inputs import make_paged_inputs  # noqa: E402

__all__ = ["__version__", "validation", "reference", "inputs", "make_paged_inputs"]

# ---- kernel side: variants, JIT build, the op (nothing compiles at import) ----------------
from . import variants  # noqa: E402
from .jit import build  # noqa: E402
from .ops import paged_attention  # noqa: E402

__all__ += ["variants", "build", "paged_attention"]
