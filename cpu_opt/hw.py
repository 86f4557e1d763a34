"""``cpu_opt.hw`` is :mod:`cpu_opt.platform.hw` (the module itself, not a copy: patching one patches
the other). Kept importable under its old name; see DESIGN.md's layout."""
import sys

from .platform import hw as _module

sys.modules[__name__] = _module
