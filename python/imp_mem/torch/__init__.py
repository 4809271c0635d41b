"""imp_mem.torch, in the middle of becoming a package (issue 53): the module
moved to ``_serve.py`` whole, so that its history follows it; the next commit
splits it into one module per concept. Until then the package *is* that
module (a monkeypatch on ``imp_mem.torch`` reaches the code that reads it)."""

import sys

from imp_mem.torch import _serve

sys.modules[__name__] = _serve
